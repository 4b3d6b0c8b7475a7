"""Every bootstrap interval contains its point estimate (docs/method.md section 5), checked on data
where the old computations (the point one way, the resamples another) excluded it."""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from dihal.stages import score as score_stage
from dihal.stages import sweep as sweep_stage
from dihal.stages.runtime import bootstrap


def test_an_interval_is_the_percentile_interval_widened_to_its_point():
    values = np.arange(1000.0)
    inside = bootstrap.interval(500.0, values)
    assert not inside["widened"]
    np.testing.assert_allclose([inside["lo"], inside["hi"]], np.percentile(values, [2.5, 97.5]), rtol=1e-12)
    outside = bootstrap.interval(-3.0, values)
    assert outside["lo"] == -3.0 and outside["hi"] == inside["hi"] and outside["widened"]
    assert np.isnan(bootstrap.interval(float("nan"), values)["lo"])


def test_the_sweeps_rho_interval_contains_its_rho_where_the_old_one_did_not():
    """Two seeds whose losses disagree, and position draws all ranked unlike draw 0: the old interval
    (the resamples never the point's own draw) lay wholly above the point rho."""
    x = np.array([6.0, 1, 5, 2, 4, 3])  # draw 0: a poor ranking
    draws = [np.array([6.0, 5, 4, 3, 2, 1]) + 0.01 * k for k in range(5)]  # the other draws: the right one
    by_seed = np.stack([-np.array([1.0, 2, 3, 4, 5, 6]), -np.array([1.0, 2, 3, 4, 6, 5])], axis=1)
    neg_loss = by_seed.mean(axis=1)
    rng = np.random.default_rng(0)
    losses = [neg_loss] + [by_seed[:, rng.integers(0, 2, 2)].mean(axis=1) for _ in range(400)]
    old = [spearmanr(draws[rng.integers(len(draws))], loss)[0] for loss in losses[1:]]
    point = spearmanr(x, neg_loss)[0]
    assert np.percentile(old, 2.5) > point  # the old computation excluded its own point
    ci = sweep_stage.interval(x, draws, losses, np.random.default_rng(1), n_seeds=2)
    assert ci["rho_lo"] <= point <= ci["rho_hi"]
    assert ci["rho_hi"] >= np.percentile(old, 50)  # it still covers the draws' rhos


def test_the_scores_interval_of_s_contains_s():
    table = pd.DataFrame({"layer": [1, 2, 3], "S": [5.0, 0.0, -5.0], "rank": [1, 2, 3]})
    draws = pd.DataFrame(  # every draw puts layer 1's S far below its draw-0 value
        {
            "draw": np.repeat(np.arange(1, 21), 3),
            "layer": np.tile([1, 2, 3], 20),
            "S": np.tile([1.0, 0.5, -1.5], 20) + np.repeat(np.linspace(0, 0.1, 20), 3),
            "rank": np.tile([1, 2, 3], 20),
        }
    )
    out = score_stage.stability(table, draws).set_index("layer")
    assert (out["S_boot_lo"] <= out["S"]).all() and (out["S"] <= out["S_boot_hi"]).all()
    assert draws[draws.layer == 1]["S"].quantile(0.975) < 5.0  # the old quantiles left S = 5 out

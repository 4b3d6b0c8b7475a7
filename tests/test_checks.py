"""Every number a claim is read from, against an independent computation (issue 50): fidelity (claims 1 and 4)
by plain torch on the original model with block l's output replaced, the comparison's curves and verdicts
(claim 3) on hand-made tables whose answers are worked out here, self-conditioning's feedback, and the
proxies reported beside S (entropy_rank, token_entropy) against NumPy."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import dihal
from dihal.stages import compare_stats as cs
from dihal.stages.fidelity import FidelityTotals, evaluate_fidelity
from dihal.stages.runtime import bootstrap
from tests.test_api import api_stores, store_of  # noqa: F401  (fixtures)


# -- fidelity ---------------------------------------------------------------------------------------------------
def fidelity_by_hand(model, bridge, ids: torch.Tensor, steps: int, seed: int = 0) -> dict:
    """docs/method.md section 3 in plain torch: the original's own forward (transformers' logits and hidden
    states), the hybrid as the same model with block l's output replaced by the bridge's sample (a forward
    hook: none of dihal's suffix model or LM head code), every metric over positions 1..T-1."""
    layer = bridge.layer
    with torch.no_grad():
        original = model(input_ids=ids, output_hidden_states=True)
        h0, h = original.hidden_states[0], original.hidden_states[layer]
        gen = torch.Generator().manual_seed(seed)  # one draw per covered position, as Bridge.noise documents
        noise = torch.randn(ids.shape[0], ids.shape[1] - bridge.start, bridge.net.cfg.dim, generator=gen)
        h_hat = bridge.sample(h0, steps, noise)

        def replace(module, args, output):
            return (h_hat.to(output[0].dtype), *output[1:]) if isinstance(output, tuple) else h_hat.to(output.dtype)

        handle = model.model.layers[layer - 1].register_forward_hook(replace)
        try:
            hybrid = model(input_ids=ids).logits.float()  # float32 logits, as fidelity's (lm_logits)
        finally:
            handle.remove()
    orig = original.logits.float()
    lp_o, lp_h = orig[:, 1:].log_softmax(-1).double(), hybrid[:, 1:].log_softmax(-1).double()
    a, b = h_hat[:, 1:].double(), h[:, 1:].double()
    nll = lambda logits: -logits[:, 1:-1].log_softmax(-1).double().gather(-1, ids[:, 2:, None]).mean()
    ppl_h, ppl_o = math.exp(float(nll(hybrid))), math.exp(float(nll(orig)))
    return {
        "kl": float(F.kl_div(lp_h, lp_o, log_target=True, reduction="none").sum(-1).mean()),  # KL(original || hybrid)
        "top1_agreement": float((hybrid[:, 1:].argmax(-1) == orig[:, 1:].argmax(-1)).double().mean()),
        "cosine": float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).mean()),
        "rel_recon_error": float(((a - b) ** 2).sum() / ((b - bridge.norm.mu_y.double()) ** 2).sum()),
        "ppl_hybrid": ppl_h,
        "ppl_original": ppl_o,
        "ppl_ratio": ppl_h / ppl_o,
    }


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fidelity_equals_a_direct_computation_by_plain_torch(kind, store_of):  # noqa: F811
    store = store_of(kind)
    hybrid = dihal.load_hybrid("latest", root=store.root)
    model, bridge = hybrid.backbone, hybrid.bridge
    with torch.no_grad():  # a random model's next-token distributions are nearly flat: sharpen them, so that
        model.lm_head.weight.mul_(10)  # KL's two directions differ by far more than the tolerance
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, hybrid.config.vocab_size, (3, 12), generator=gen)
    ids[:, 0] = hybrid.start_id
    for steps in (1, 4):
        measured = evaluate_fidelity(model, bridge, ids, [steps], batch_size=3, seed=0)[steps].metrics()
        by_hand = fidelity_by_hand(model, bridge, ids, steps)
        assert set(measured) == set(by_hand)
        for name, value in by_hand.items():
            if name.startswith("ppl"):  # a perplexity to 1e-6 in its log: the mean NLL to 1e-6 nats
                assert math.log(measured[name]) == pytest.approx(math.log(value), abs=1e-6), name
            else:
                assert measured[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


def _totals(h_hat, h, hidden_h, hidden_o, ids, mu=None):
    t = FidelityTotals()
    mu = h[:, 1:].reshape(-1, h.shape[-1]).mean(0) if mu is None else mu
    t.add(h_hat, h, mu, lambda x: x, hidden_h, hidden_o, ids)  # the head is the identity: hidden = logits
    return t.metrics(), mu


def test_fidelity_on_states_with_known_answers():
    gen = torch.Generator().manual_seed(0)
    h, logits = torch.randn(2, 6, 8, generator=gen), torch.randn(2, 6, 5, generator=gen)
    ids = torch.randint(0, 5, (2, 6), generator=gen)
    same, mu = _totals(h, h, logits, logits, ids)
    assert same == pytest.approx(
        {"rel_recon_error": 0, "cosine": 1, "kl": 0, "top1_agreement": 1, "ppl_ratio": 1}
        | {k: same[k] for k in ("ppl_hybrid", "ppl_original")}
    )
    shift = torch.tensor([0.5, -1.0, 0, 0, 2.0, 0, 0, 0.25])
    shifted, _ = _totals(h + shift, h, logits, logits, ids)
    expected = 2 * 5 * float((shift**2).sum()) / float(((h[:, 1:] - mu) ** 2).sum())  # 10 positions past 0
    assert shifted["rel_recon_error"] == pytest.approx(expected, rel=1e-6)
    # KL's direction: the original's p = (0.5, 0.5), the hybrid's q = (0.9, 0.1) at every position
    p, q = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.9, 0.1]).log()
    kl, _ = _totals(h[:, :, :2], h[:, :, :2], q.expand(2, 6, 2), p.expand(2, 6, 2), ids.clamp(max=1))
    assert kl["kl"] == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-6)
    assert kl["top1_agreement"] == 1.0  # a tie on the original's side: argmax takes the first, as the hybrid's


# -- the comparison's curves and verdicts (claim 3) --------------------------------------------------------------
def samples(spec: dict, budget: int = 1, source: str = "prior", per: int = 4) -> pd.DataFrame:
    """{row: [(temperature, entropy, Gen.PPL), ...]} -> a samples table whose every group has exactly that
    entropy and Gen.PPL (each sample: 10 tokens whose NLL sums to 10 ln PPL)."""
    rows = []
    for row, points in spec.items():
        for temperature, entropy, ppl in points:
            for i in range(per):
                nll = 10 * math.log(ppl)
                rows.append(
                    {"budget": budget, "seed": 0, "row": row, "source": source, "kind": "curve", "index": i}
                    | {"temperature": temperature, "token_entropy": entropy, "text": f"w{i} x{i} y z q r"}
                    | {"nll_evaluator": nll, "n_evaluator": 10, "nll_backbone": nll, "n_backbone": 10, "n_tokens": 10}
                )
    return pd.DataFrame(rows)


DIHAL = [(0.0, 2.0, 100.0), (0.7, 3.0, 50.0), (1.0, 4.0, 20.0)]


def test_the_headline_is_the_curve_interpolated_in_log_gen_ppl_at_the_held_out_entropy():
    table = samples({"DiHAL": DIHAL})
    at = math.exp(cs.log_ppl_at(table, "evaluator", 3.5, "curve"))
    assert at == pytest.approx(math.sqrt(50 * 20))  # halfway between 3 and 4 in entropy, in log Gen.PPL
    assert math.exp(cs.log_ppl_at(table, "evaluator", 2.25, "curve")) == pytest.approx(100**0.75 * 50**0.25)
    assert math.isnan(cs.log_ppl_at(table, "evaluator", 4.2, "curve"))
    assert cs.status(table, "curve", 4.2, float("nan")) == "not reached"
    assert cs.status(table, "curve", 3.5, at) == "ok"
    assert cs.status(table, "curve", 5.0, float("nan")) == "degenerate"  # every entropy below 0.9 x 5
    point = samples({"SED": [(None, 3.3, 70.0)]})
    assert math.exp(cs.log_ppl_at(point, "evaluator", 99.0, "point")) == pytest.approx(70.0)


@pytest.mark.parametrize(
    "baseline,outcome",
    [
        ([(0.7, 2.5, 200.0), (1.0, 3.5, 100.0)], "DiHAL better"),
        ([(0.7, 2.5, 10.0), (1.0, 3.5, 5.0)], "baseline better"),
        ([(0.7, 2.5, 200.0), (1.0, 3.5, 5.0)], "mixed"),
        ([(0.7, 5.0, 10.0), (1.0, 6.0, 5.0)], "not comparable (entropies not reached)"),
        ([(0.7, 1.0, 10.0), (1.0, 1.5, 5.0)], "baseline degenerate"),
    ],
)
def test_each_verdict_word_on_a_table_made_to_give_it(baseline, outcome):
    table = samples({"DiHAL": DIHAL, "SED": baseline})
    v = cs.verdict(table, "DiHAL", "SED", "evaluator", 3.0)
    assert v["outcome"] == outcome
    first = v["points"][0]
    assert first["baseline_gen_ppl"] == pytest.approx(baseline[0][2])
    if outcome not in ("not comparable (entropies not reached)", "baseline degenerate"):
        assert first["dihal_gen_ppl"] == pytest.approx(math.sqrt(100 * 50))  # at entropy 2.5


def test_a_degenerate_dihal_is_named_and_decides_the_claim():
    table = samples({"DiHAL": [(0.0, 1.0, 100.0), (1.0, 2.0, 50.0)], "SED": [(0.7, 2.9, 10.0), (1.0, 3.5, 5.0)]})
    v = cs.verdict(table, "DiHAL", "SED", "evaluator", 3.0)
    assert v["outcome"] == "DiHAL degenerate"
    assert cs.claim([v, {"outcome": "DiHAL better"}]) == "does not hold (DiHAL degenerate)"


@pytest.mark.parametrize(
    "outcomes,word",
    [
        (["DiHAL better", "DiHAL better"], "holds"),
        (["baseline better", "mixed"], "does not hold"),
        (["DiHAL better", "baseline better"], "partly"),
        (["DiHAL better", "mixed"], "partly"),
        (["baseline degenerate", "not comparable (entropies not reached)"], "not testable (no comparable baseline)"),
        (["DiHAL better", "baseline LM-written"], "holds"),  # an LM-written baseline decides nothing
        (["DiHAL better", "DiHAL LM-written"], "not decided (DiHAL LM-written)"),
    ],
)
def test_claim_3_at_one_budget(outcomes, word):
    assert cs.claim([{"outcome": o} for o in outcomes]) == word


def test_by_class_compares_like_with_like_and_lm_written_rows_decide_nothing():
    table = samples(
        {"DiHAL": DIHAL, "SED": [(0.7, 2.5, 200.0), (1.0, 3.5, 100.0)], "CoDAR": [(0.7, 2.5, 10.0), (1.0, 3.5, 5.0)]}
    )
    costs = {"DiHAL": "one-pass", "SED": "one-pass", "CoDAR": "token-by-token"}

    def heads(lm_written: dict) -> pd.DataFrame:
        return pd.DataFrame(
            [{"budget": 1, "row": r, "cost": c, "lm_written": lm_written.get(r)} for r, c in costs.items()]
        )

    (plain,) = cs.by_class(table, heads({}), ["DiHAL"], ["SED", "CoDAR"], 3.0, [1])
    assert plain["class"] == "one-pass" and [b["baseline"] for b in plain["baselines"]] == ["SED"]
    assert plain["claim_3"] == "holds"
    (sed_lm,) = cs.by_class(table, heads({"SED": True}), ["DiHAL"], ["SED", "CoDAR"], 3.0, [1])
    assert sed_lm["baselines"][0] | {"points": None} == {
        "baseline": "SED",
        "outcome": "baseline LM-written",
        "measured": "DiHAL better",
        "points": None,
    }
    assert sed_lm["claim_3"] == "not testable (no comparable baseline)"
    (mine_lm,) = cs.by_class(table, heads({"DiHAL": True}), ["DiHAL"], ["SED", "CoDAR"], 3.0, [1])
    assert mine_lm["claim_3"] == "not decided (DiHAL LM-written)"


def test_a_renamed_row_or_source_changes_the_written_labels_and_no_statistic(monkeypatch):
    """Rows and sources travel through the statistics as keys and become labels only when written: with
    SED's row renamed and the trained prior's source relabelled, every number of the headlines, the lines
    and the verdicts is the same, and only the written names differ."""
    from dataclasses import replace

    from dihal.stages import compare, registry
    from dihal.stages.configs import CompareConfig

    table = pd.concat(
        [
            samples({"dihal": DIHAL, "sed": [(None, 2.8, 200.0)]}),
            samples({"dihal": [(1.0, 3.0, 60.0)], "sed": [(None, 2.8, 300.0)]}, source="null"),
        ],
        ignore_index=True,
    )
    table["cost"] = table["row"].map({"dihal": "one-pass", "sed": "one-pass"})
    table.loc[table.row == "sed", "kind"] = "point"
    monkeypatch.setattr(cs, "bootstrap_resamples", lambda n: 20)  # the intervals' width is not what is tested
    cfg = CompareConfig(rows=("dihal", "sed"), controls=("dihal", "sed"), temperatures=(0.0, 0.7, 1.0), seeds=(0,))
    plan = compare.Plan(l_star=3, worst=1, backbone="m", short="m", primary="e")

    def written(stats: dict) -> dict:
        rows = compare.row_labels(cfg, plan)
        return {k: compare.labelled(stats[k], rows) for k in ("lines", "heads", "controls")}

    before = cs.analyse(table, 3.0, cfg, "dihal", ["sed"], None, [], dihal=["dihal"])
    plain = written(before)
    renamed_rows = tuple(replace(r, name="Self-conditioned") if r.key == "sed" else r for r in registry.ROWS)
    monkeypatch.setattr(registry, "ROWS", renamed_rows)
    monkeypatch.setitem(registry.SOURCE_LABELS, "prior", "trained")
    after = cs.analyse(table, 3.0, cfg, "dihal", ["sed"], None, [], dihal=["dihal"])
    relabelled = written(after)
    assert after["verdicts"] == before["verdicts"] and after["by_class"] == before["by_class"]
    assert before["verdicts"][0]["baselines"][0]["outcome"] == cs.Outcome.DIHAL_BETTER
    for name, frame in plain.items():
        numbers = frame.select_dtypes("number").columns
        assert len(frame) and len(numbers) > 3
        pd.testing.assert_frame_equal(relabelled[name][numbers], frame[numbers])
    assert set(plain["heads"]["row"]) == {"DiHAL (l*=3)", "SED"}
    assert set(relabelled["heads"]["row"]) == {"DiHAL (l*=3)", "Self-conditioned"}
    assert "trained" in set(relabelled["lines"]["source"]) and "trained prior" in set(plain["lines"]["source"])
    assert plain["heads"].set_index("row")["prior_gain"]["SED"] == pytest.approx(1.5)


def test_prior_gain_is_the_null_priors_gen_ppl_over_the_trained_priors():
    trained = samples({"SED": [(1.0, 3.0, 40.0)]})
    null = samples({"SED": [(1.0, 3.0, 100.0)]}, source="null")
    both = pd.concat([trained, null], ignore_index=True)
    assert cs.whose_text(both, 1, "SED") == {
        "prior_gain": pytest.approx(2.5),
        "plan_agreement": pytest.approx(np.nan, nan_ok=True),
        "lm_written": False,
    }
    weak = pd.concat([trained, samples({"SED": [(1.0, 3.0, 50.0)]}, source="null")], ignore_index=True)
    assert (
        cs.whose_text(weak, 1, "SED")["prior_gain"] == pytest.approx(1.25)
        and cs.whose_text(weak, 1, "SED")["lm_written"]
    )


def test_headline_intervals_on_tables_whose_bootstrap_is_known():
    """Two seeds: one's samples all at Gen.PPL 10, the other's all at 1000. A resample of seeds is (10, 10),
    (1000, 1000) or a mix (100, the token-weighted geometric mean), so 400 resamples give the percentile
    interval [10, 1000] whatever the draws; one seed alone gives [point, point]."""
    low, high = samples({"SED": [(None, 3.0, 10.0)]}), samples({"SED": [(None, 3.0, 1000.0)]})
    high["seed"] = 1
    table = pd.concat([low, high], ignore_index=True)
    head = cs.headline(table, "point", 3.0, np.random.default_rng(0), 400)
    assert head["headline_evaluator"] == pytest.approx(100.0)
    assert head["headline_evaluator_lo"] == pytest.approx(10.0) and head["headline_evaluator_hi"] == pytest.approx(
        1000.0
    )
    one = cs.headline(low, "point", 3.0, np.random.default_rng(0), 50)
    assert one["headline_evaluator_lo"] == one["headline_evaluator_hi"] == pytest.approx(10.0)


def _random_samples(seed: int, seeds: int = 3, n: int = 12, nan_temperature: bool = False) -> pd.DataFrame:
    rng, rows = np.random.default_rng(seed), []
    for s in range(seeds):
        for i in range(n):
            for t in [0.0, 0.7, 1.0] + ([np.nan] if nan_temperature else []):
                tokens = int(rng.integers(0, 20))  # some samples score no token
                rows.append(
                    {"seed": s, "index": i, "temperature": t, "token_entropy": rng.uniform(2, 5)}
                    | {f"n_{ev}": tokens for ev in cs.EVALUATORS}
                    | {f"nll_{ev}": rng.uniform(0, 5) * tokens for ev in cs.EVALUATORS}
                )
    return pd.DataFrame(rows)


@pytest.mark.parametrize("case", range(4))
def test_headline_draws_resamples_rows_and_gives_the_merged_frames_numbers_bit_for_bit(case):
    """headline() resamples row positions with numpy (45x faster than a DataFrame merge per resample); its
    intervals equal, to the bit, those of resample()'s frames scored by log_ppl_at() from the same generator,
    for curves and points, NaN temperatures, one seed, and a seed missing a sample (the frames' own path)."""
    table = _random_samples(case, seeds=1 if case == 1 else 3, nan_temperature=case == 2)
    if case == 3:
        table = table[~((table.seed == 1) & (table["index"] == 4))]
    for kind in ("point", "curve"):
        fast = cs.headline(table, kind, 3.5, np.random.default_rng(case), 60)
        rng = np.random.default_rng(case)
        frames = [cs.resample(table, rng) for _ in range(60)]
        for ev in cs.EVALUATORS:
            point = float(np.exp(cs.log_ppl_at(table, ev, 3.5, kind)))
            ci = bootstrap.interval(point, [float(np.exp(cs.log_ppl_at(d, ev, 3.5, kind))) for d in frames])
            for key, want in (
                (f"headline_{ev}", point),
                (f"headline_{ev}_lo", ci["lo"]),
                (f"headline_{ev}_hi", ci["hi"]),
            ):
                assert fast[key] == want or (np.isnan(fast[key]) and np.isnan(want)), (kind, key, fast[key], want)


def test_an_interval_is_the_percentile_interval_and_says_when_it_was_widened_to_its_point():
    from dihal.stages.runtime import bootstrap

    draws = np.random.default_rng(1).normal(5.0, 1.0, 2000)
    inside = bootstrap.interval(5.0, draws)
    lo, hi = np.percentile(draws, [2.5, 97.5])
    assert inside == {"lo": pytest.approx(lo), "hi": pytest.approx(hi), "widened": False}
    outside = bootstrap.interval(20.0, draws)  # the bootstrap says the point is not where its resamples are
    assert outside == {"lo": pytest.approx(lo), "hi": 20.0, "widened": True}


# -- self-conditioning -------------------------------------------------------------------------------------------
class RecordingNet(torch.nn.Module):
    """A denoiser stub: records the x0_prev it is given and returns 0.5 x + 0.25 x0_prev (0 without one)."""

    def __init__(self, dim: int):
        super().__init__()
        self.cfg = type("Cfg", (), {"dim": dim})()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def forward(self, x, t, x0_prev=None):
        self.seen.append(None if x0_prev is None else x0_prev.clone())
        return 0.5 * x + (0.25 * x0_prev if x0_prev is not None else 0)


@pytest.mark.parametrize("self_condition", [True, False])
def test_self_conditioning_feeds_each_steps_estimate_to_the_next(self_condition):
    from dihal.stages.diffusion.normalizer import Normalizer
    from dihal.stages.parts.prior import Prior

    unit = Normalizer(torch.zeros(3), torch.ones(3), torch.zeros(3), torch.ones(3), torch.zeros(3))
    prior = Prior(RecordingNet(3), unit, 0, self_condition, 5)
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0))
    out = prior._integrate(x.clone(), 4, None)
    # Euler on the flow path by hand: y = 0.5 x + 0.25 y_prev, x <- x + (t' - t)(x - y) / t, y_prev(0) = 0
    grid, mine, prev, estimates = [1, 0.75, 0.5, 0.25, 0], x.clone(), torch.zeros_like(x), []
    for t, t_next in zip(grid, grid[1:]):
        y = 0.5 * mine + (0.25 * prev if self_condition else 0)
        estimates.append(y)
        prev = y
        mine = y if t_next == 0 else mine + (t_next - t) * (mine - y) / t
    torch.testing.assert_close(out, mine)
    if self_condition:
        torch.testing.assert_close(prior.net.seen[0], torch.zeros_like(x))
        for step in range(1, 4):  # each step is given the previous step's estimate
            torch.testing.assert_close(prior.net.seen[step], estimates[step - 1])
    else:
        assert prior.net.seen == [None] * 4


# -- the proxies reported beside S ------------------------------------------------------------------------------
def test_entropy_rank_against_numpy():
    from dihal.stages.score import covariance, spectrum_stats

    k, d = 3, 6
    basis = np.eye(d)[:k] * 2.0
    x = np.concatenate([basis, -basis])  # k orthogonal directions of equal variance: entropy rank exactly k
    eig = torch.linalg.eigh(covariance(torch.from_numpy(x)))[0]
    assert spectrum_stats(eig)["entropy_rank"] == pytest.approx(k)
    rng = np.random.default_rng(0)
    y = rng.normal(size=(500, d)) * np.array([3.0, 2.0, 1.0, 0.5, 0.2, 0.1])
    lam = np.clip(np.linalg.eigvalsh(np.cov(y, rowvar=False)), 0, None)
    p = lam / lam.sum()
    expected = math.exp(-(p[p > 0] * np.log(p[p > 0])).sum())
    got = spectrum_stats(torch.linalg.eigh(covariance(torch.from_numpy(y)))[0])["entropy_rank"]
    assert got == pytest.approx(expected, rel=1e-9)


def test_token_entropy_against_numpy():
    from dihal.stages.text.text_metrics import token_entropy

    assert token_entropy([[7, 7, 7, 7]]) == 0.0
    assert token_entropy([[1, 2, 3, 4]]) == pytest.approx(math.log(4))
    rows = [[1, 1, 2, 3, 3, 3], [5, 6], []]  # the empty sample is left out of the mean

    def numpy_entropy(ids):
        _, counts = np.unique(ids, return_counts=True)
        p = counts / counts.sum()
        return float(-(p * np.log(p)).sum())

    assert token_entropy(rows) == pytest.approx(np.mean([numpy_entropy(r) for r in rows[:2]]))


# -- a builtin's recorded shape is its converted config -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_a_builtins_recorded_shape_is_its_converted_config(name):
    """--dry-run reads the shape recorded beside a builtin instead of converting it (nothing written on a cold
    cache): it must be the converted model's."""
    from transformers import AutoConfig

    from dihal.stages.lm.models import BUILTINS, locate

    config = AutoConfig.from_pretrained(str(locate(name)[0]))
    config = getattr(config, "text_config", config)
    assert {k: getattr(config, k) for k in BUILTINS[name]["shape"]} == BUILTINS[name]["shape"]

"""scripts/hybrid_study.py's curve points and the bootstrap interval of its matched-entropy reading (issue 66)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dihal.stages.evaluate import gen_ppl
from dihal.stages.text.text_metrics import token_entropy
from tests.conftest import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("hybrid_study")


def samples(rng, n: int, temperature: float) -> tuple[list[list[int]], pd.DataFrame]:
    """n token-id samples (some empty, as after an early stop) and their units, NLL rising with temperature."""
    ids = [[] if i % 10 == 9 else list(rng.integers(0, int(8 * temperature**4), 24)) for i in range(n)]
    nll = [float(rng.gamma(2.0, temperature) * len(s)) for s in ids]
    units = pd.DataFrame(
        {"sample": range(n), "entropy": [token_entropy([s]) for s in ids], "nll": nll, "tokens": [len(s) for s in ids]}
    )
    return ids, units


def test_a_curve_point_is_the_mean_entropy_and_the_gen_ppl_per_token_of_its_samples(study):
    ids, units = samples(np.random.default_rng(0), 40, 1.0)
    assert any(not s for s in ids)  # empty samples count in neither figure
    got = study.point(units)
    assert got["entropy"] == pytest.approx(token_entropy(ids), rel=1e-12)
    want = gen_ppl(list(zip(units.nll, units.tokens)))["gen_ppl_token"]
    assert got["gen_ppl"] == pytest.approx(want, rel=1e-12)


def units_for(rng, n: int, shift: float) -> dict:
    """The original at three temperatures, and a hybrid writing the same samples at exp(shift) times the Gen.PPL."""
    out = {}
    for t in (0.7, 0.85, 1.0):
        _, u = samples(rng, n, t)
        out[("original", t)] = u
        out[("hybrid", t)] = u.assign(nll=u.nll + shift * u.tokens)
    return out


def test_the_bootstrap_resamples_the_same_samples_at_every_point(study):
    """A hybrid that writes the original's samples at e^0.3 times the Gen.PPL reads e^0.3 on every resample, so
    its interval has no width; resampling each point on its own would move the entropies apart and widen it."""
    units = units_for(np.random.default_rng(1), 48, 0.3)
    curves = [{"model": m, "temperature": t} | study.point(u) for (m, t), u in units.items()]
    at, where, ratio = study.reading(curves, "hybrid")
    assert where == "the original's entropy at temperature 1"
    assert ratio == pytest.approx(math.exp(0.3), rel=1e-9)
    lo, hi = study.bootstrap(units, "hybrid", 200)
    assert lo == pytest.approx(math.exp(0.3), rel=1e-9) and hi == pytest.approx(math.exp(0.3), rel=1e-9)
    # both at temperature 1, no interpolation: the same ratio, the entropies' gap none, the interval no width
    one = study.at_one(units, "hybrid", 200)
    assert one["ratio"] == pytest.approx(math.exp(0.3), rel=1e-9) and one["entropy_gap"] == 0
    assert one["ratio_90"] == pytest.approx([math.exp(0.3)] * 2, rel=1e-9)


def test_the_bootstrap_interval_holds_the_reading_and_narrows_with_more_samples(study):
    """A hybrid with its own samples (independent of the original's): the interval has width, holds the point
    reading, and is narrower at 16 times the samples (about a quarter, as 1 / sqrt(n))."""
    width = {}
    for n in (32, 512):
        rng = np.random.default_rng(2)
        units = {}
        for t in (0.7, 0.85, 1.0):
            units[("original", t)] = samples(rng, n, t)[1]
            units[("hybrid", t)] = samples(rng, n, t * 1.1)[1]
        curves = [{"model": m, "temperature": t} | study.point(u) for (m, t), u in units.items()]
        ratio = study.reading(curves, "hybrid")[2]
        lo, hi = study.bootstrap(units, "hybrid", 300)
        assert lo < ratio < hi
        width[n] = math.log(hi / lo)
    assert 0.1 < width[512] / width[32] < 0.5


def draw_dir(path, rng, n: int, bridge: str = "b", shift: float = 0.2) -> dict:
    """A study's output directory with its curve samples, as scripts/hybrid_study.py writes them."""
    path.mkdir()
    units = units_for(rng, n, shift)
    pd.concat([u.assign(model=m, temperature=t) for (m, t), u in units.items()]).to_csv(
        path / "curve_samples.csv", index=False
    )
    (path / "study.json").write_text(json.dumps({"bridge": bridge, "tokens": 63, "top_p": 1.0}))
    return units


def test_pooled_draws_are_read_as_one_draw_of_all_their_samples(study, tmp_path, monkeypatch):
    """scripts/hybrid_pool.py: two draws pooled give the point and the interval of their samples joined, the
    second's numbered after the first's; draws of another bridge are refused."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    pool = load_script("hybrid_pool")
    rng = np.random.default_rng(3)
    first, second = draw_dir(tmp_path / "a", rng, 30), draw_dir(tmp_path / "b", rng, 20)
    units = pool.pooled([tmp_path / "a", tmp_path / "b"])
    assert len(units) == 6 and all(len(u) == 50 for u in units.values())
    joined = {
        k: pd.concat([first[k], second[k].assign(sample=second[k]["sample"] + 30)], ignore_index=True) for k in first
    }
    for k in first:
        assert units[k]["sample"].tolist() == list(range(50))
        assert study.point(units[k]) == pytest.approx(study.point(joined[k]), rel=1e-12)
    assert study.bootstrap(units, "hybrid", 100) == study.bootstrap(joined, "hybrid", 100)
    draw_dir(tmp_path / "c", rng, 20, bridge="another")
    with pytest.raises(SystemExit, match="the draws differ in bridge"):
        pool.pooled([tmp_path / "a", tmp_path / "c"])


def test_two_bridges_are_compared_sample_by_sample(study, tmp_path, monkeypatch):
    """scripts/hybrid_pool.py --against: the hybrid's Gen.PPL at temperature 1 over another bridge's at the same
    seeds. Each resample pairs sample i with sample i, so every resampled ratio lies between the smallest and the
    largest per-sample ratio (a mediant), which resampling each bridge on its own would break; draws of unequal
    size are refused."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    pool = load_script("hybrid_pool")
    rng = np.random.default_rng(5)
    units = units_for(rng, 40, 0.2)
    h = units[("hybrid", 1.0)]
    h = h[h.tokens > 0].reset_index(drop=True)
    extra = rng.uniform(0.05, 0.3, len(h)) * h.tokens  # the other bridge: more NLL on every sample
    other = {("hybrid", 1.0): h.assign(nll=h.nll + extra)}
    r = pool.between({("hybrid", 1.0): h}, other, "hybrid", 400)
    expected = math.exp(-extra.sum() / h.tokens.sum())
    assert r["ratio"] == pytest.approx(expected, rel=1e-12)
    per_sample = np.exp(-extra / h.tokens)
    lo, hi = r["ratio_90"]
    assert per_sample.min() <= lo < expected < hi <= per_sample.max()
    with pytest.raises(SystemExit, match="compare draws of the same seeds"):
        pool.between({("hybrid", 1.0): h}, {("hybrid", 1.0): h.iloc[:-1]}, "hybrid", 10)


def test_two_arms_of_bridges_are_compared_over_bridges_not_samples(tmp_path, monkeypatch):
    """scripts/hybrid_arms.py: a bridge reads its hybrid / original Gen.PPL at temperature 1 over its draws pooled;
    the arms' ratio is that of their geometric means, its t is scipy's two-sample t on the logs (equal variances),
    and the interval's upper end is under 1 exactly when scipy's one-sided p is under 0.05."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    arms = load_script("hybrid_arms")
    rng = np.random.default_rng(11)
    draw_dir(tmp_path / "x1", rng, 20, shift=0.3)
    draw_dir(tmp_path / "x2", rng, 30, shift=0.3)
    assert arms.ratio_at_one([tmp_path / "x1", tmp_path / "x2"]) == pytest.approx(math.exp(0.3), rel=1e-12)
    shown = []
    for a, b in (([1.62, 1.46], [1.41, 1.58]), ([1.62, 1.60, 1.58], [1.30, 1.33])):
        r = arms.between_arms(a, b)
        assert r["ratio"] == pytest.approx(math.exp(np.log(b).mean() - np.log(a).mean()), rel=1e-12)
        assert r["t"] == pytest.approx(stats.ttest_ind(np.log(b), np.log(a)).statistic, rel=1e-12)
        assert r["df"] == len(a) + len(b) - 2
        assert r["interval"][0] < r["ratio"] < r["interval"][1]
        p = stats.ttest_ind(np.log(b), np.log(a), alternative="less").pvalue
        shown.append(r["interval"][1] < 1)
        assert shown[-1] == (p < 0.05)
    assert shown == [False, True]
    with pytest.raises(SystemExit, match="each arm needs two training seeds"):
        arms.between_arms([1.5], [1.4, 1.3])


def test_paired_arms_are_compared_over_the_seeds_log_ratios(monkeypatch):
    """scripts/hybrid_arms.py --paired: the same seeds in both arms; the interval is the mean per-seed log ratio +-
    Student's t quantile x its standard error (n - 1 df), by hand, and a shared seed effect that hides a lever from
    the unpaired t does not hide it from the paired one."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    arms = load_script("hybrid_arms")
    a = [2.06, 1.93, 2.35, 2.67]  # seeds that differ a lot between them
    b = [x * f for x, f in zip(a, [0.90, 0.88, 0.93, 0.91], strict=True)]  # each about 9% lower, the same seeds
    d = np.log(b) - np.log(a)
    half = stats.t.ppf(0.95, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    r = arms.between_arms(a, b, paired=True)
    assert r["ratio"] == pytest.approx(math.exp(d.mean()), rel=1e-12)
    assert r["interval"] == pytest.approx([math.exp(d.mean() - half), math.exp(d.mean() + half)], rel=1e-9)
    assert r["df"] == len(a) - 1
    assert r["interval"][1] < 1 < arms.between_arms(a, b)["interval"][1]
    with pytest.raises(SystemExit, match="paired arms hold the same seeds"):
        arms.between_arms(a, b[:3], paired=True)


def test_one_arm_of_bridges_is_read_against_a_target_over_bridges(monkeypatch):
    """scripts/hybrid_arms.py --target: the arm's geometric mean and its 90% interval over bridges, by hand (the mean
    log ratio +- Student's t quantile x its standard error), and which side of the target the interval shows."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    arms = load_script("hybrid_arms")
    verdicts = []
    for a in ([2.063, 1.929], [1.93, 1.90, 1.95, 1.92], [1.62, 1.58, 1.60], [2.5, 2.6, 2.55]):
        la = np.log(a)
        half = stats.t.ppf(0.95, len(a) - 1) * la.std(ddof=1) / math.sqrt(len(a))
        r = arms.one_arm(a, 2.0)
        assert r["ratio"] == pytest.approx(math.exp(la.mean()), rel=1e-12)
        assert r["interval"] == pytest.approx([math.exp(la.mean() - half), math.exp(la.mean() + half)], rel=1e-9)
        assert r["df"] == len(a) - 1
        verdicts.append(r["verdict"])
    assert verdicts == ["not shown either way", "under", "under", "over"]
    with pytest.raises(SystemExit, match="an arm needs two training seeds"):
        arms.one_arm([1.9], 2.0)


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_the_plateau_probe_holds_attention_to_each_position_and_lets_go(positions):
    """scripts/plateau_probe.py: under own_position_only a position's output no longer moves when another
    position's input does (it did before); on leaving, attention is causal again. SkipOnly is A c."""
    import torch

    from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig

    probe = load_script("plateau_probe")
    torch.manual_seed(0)
    net = Denoiser(DenoiserConfig(dim=6, width=16, depth=2, heads=2, max_len=8, positions=positions))
    for blk in net.blocks:  # gates open, so attention matters
        torch.nn.init.normal_(blk.modulation.weight, std=0.5)
    x, c, t = torch.randn(1, 5, 6), torch.randn(1, 5, 6), torch.tensor([0.4])
    moved = x.clone()
    moved[:, 1] += 3.0
    with torch.no_grad():
        before = (net(x, t, c)[:, 4] - net(moved, t, c)[:, 4]).abs().max()
        with probe.own_position_only():
            held = (net(x, t, c)[:, 4] - net(moved, t, c)[:, 4]).abs().max()
        after = (net(x, t, c)[:, 4] - net(moved, t, c)[:, 4]).abs().max()
        skip = probe.SkipOnly(net)(x, t, c)
    assert before > 1e-3 and after == before and held < 1e-6
    assert torch.equal(skip, net.skip(c))

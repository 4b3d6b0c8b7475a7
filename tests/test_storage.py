"""Stores as small as their values allow: position 0 kept apart in float32 so the other positions
fit float16, and a disk estimate that matches what an extract writes."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore, dir_size
from tests.conftest import build_tiny, invoke

SINK = 1e6  # far beyond float16's 65504


@pytest.fixture()
def sink_model(tmp_path):
    """A tiny Llama whose start token (BOS, id 1) embeds at 1e6: its state at position 0 exceeds
    float16 at every layer, every other position stays small (the blocks are pre-norm)."""
    model, tok = build_tiny("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[tok.bos_token_id] = SINK
    path = tmp_path / "sink"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model


def test_auto_keeps_float16_and_position_0_exact(sink_model, root):
    path, model = sink_model
    res = invoke("extract", "--model", str(path), "--max-sequences", "12", "--seq-len", "16", "--device", "cpu")
    assert res.exit_code == 0, res.output
    art = ArtifactStore(root).resolve("latest", "extract")
    group = hs.open_group(art)
    assert set(hs.layer_dtypes(group).values()) == {"float16"}  # chosen from positions >= 1
    ids = torch.from_numpy(np.asarray(group["input_ids"][:]).astype(np.int64))
    with torch.no_grad():  # an independent forward: HF's hidden_states[l] is layer l for l < L
        reference = model(ids, output_hidden_states=True).hidden_states
    for layer in range(len(reference) - 1):
        stored = hs.read_sequences(group, layer, np.arange(ids.shape[0]))
        expected = reference[layer].float().numpy()
        assert stored.dtype == np.float32
        assert np.abs(expected[:, 0]).max() > 65504  # the case this is about
        np.testing.assert_allclose(stored[:, 0], expected[:, 0], rtol=1e-6)  # position 0 exact
        np.testing.assert_allclose(stored[:, 1:], expected[:, 1:].astype(np.float16), rtol=0, atol=0)
        block = hs.read_block(group, layer, 2, 5)
        np.testing.assert_array_equal(block, stored[2:5])
        positions = hs.read_positions(group, layer, np.array([3, 0, 7]), np.array([0, 5, 0]))
        np.testing.assert_array_equal(positions, stored[[3, 0, 7], [0, 5, 0]])


def test_an_extract_without_pos0_still_loads(tmp_path):
    """Extracts written before pos0 existed read as stored."""
    group = hs.create(tmp_path / "old.zarr", [0], 3, 4, 2, {0: "float32"}, 2, {})
    values = np.arange(24, dtype=np.float32).reshape(3, 4, 2)
    group["layers/0"][:] = values
    np.testing.assert_array_equal(hs.read_sequences(group, 0, np.arange(3)), values)
    old16 = hs.create(tmp_path / "old16.zarr", [0], 3, 4, 2, {0: "float16"}, 2, {})
    del old16["pos0"]  # as an extract of the landed main: float16, no pos0 array
    old16["layers/0"][:] = values
    assert hs.read_sequences(old16, 0, np.arange(3)).dtype == np.float16


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, keep, layers",
    [("llama", "layers", "all"), ("gemma3", "layers", "all"), ("llama", "pool", "all")]
    + [("llama", "pool", "1-4")],  # no layer 0: nothing held whole
)
def test_the_plan_estimate_is_within_10_percent_of_the_bytes_written(kind, keep, layers, tiny_dirs, root):
    from dihal.stages import extract as stage
    from dihal.stages.configs import DataConfig, ExtractConfig

    data = DataConfig(max_sequences=64, seq_len=32)
    pool = 16384 if keep == "layers" else 600
    cfg = ExtractConfig(model=str(tiny_dirs[kind]), data=data, keep=keep, score_pool=pool, layers=layers)
    estimate = stage.plan(cfg).bytes_estimate
    art = stage.run(cfg, ArtifactStore(root))
    written = dir_size(art.path / "hidden.zarr")
    assert abs(estimate - written) <= 0.1 * written, (estimate, written)


@pytest.mark.slow
def test_the_main_job_runs_the_chain_and_ends_with_one_summary(tiny_dirs, tmp_path):
    """README's main job (scripts/main_job.sh), on a tiny model: six numbered steps, then one table
    with l*, fidelity naming its text, Gen.PPL and diversity of both models, and the plots."""
    import os
    import subprocess

    from tests.conftest import ROOT

    env = {**os.environ, "MODEL": str(tiny_dirs["llama"]), "SEQUENCES": "96", "BRIDGE_STEPS": "4"}
    env |= {"DIHAL_ROOT": str(tmp_path / "runs"), "COLUMNS": "80"}
    proc = subprocess.run(["bash", "scripts/main_job.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert [line[:12] for line in out.splitlines() if line.startswith("== step")] == [
        f"== step {k}/6:" for k in range(1, 7)
    ]
    summary = (tmp_path / "runs" / "summary.md").read_text()
    # the paper's path: S alone (dihal's r2_token comes with SELECT=r2_token or PROXIES=all)
    assert "| l* by S, the paper's (argmax S) |" in summary and "r2_token" not in summary
    assert "| fidelity on held-out text (validation split), 8 steps |" in summary
    assert (
        "| hybrid: Gen.PPL, diversity, entropy |" in summary and "| original: Gen.PPL, diversity, entropy |" in summary
    )
    matched = next(line for line in summary.splitlines() if "| hybrid / original Gen.PPL at matched entropy |" in line)
    assert "90% over samples" in matched or matched.endswith("reads the curves at one entropy |"), matched
    # the interval's reading of the evaluation's own per-sample file (the tiny run's entropies are rarely matched)
    from tests.conftest import load_script

    summarize = load_script("summarize")
    evaluation = summarize.latest(ArtifactStore(tmp_path / "runs"), "evaluate", "samples")
    lo, hi = summarize.ratio_interval(pd.read_csv(evaluation.file("per_sample.csv")))
    assert 0 < lo < hi < float("inf")
    plots = [line.split("`")[1] for line in summary.splitlines() if line.startswith("plot:")]
    assert len(plots) == 2 and all(os.path.exists(p) for p in plots)


def test_the_summary_gives_the_gen_ppl_ratio_only_at_matched_entropy():
    """issue 66 item 4: the main job's ratio is read where the two models' token entropies agree within 2% of
    the original's; a hotter hybrid's ratio is refused, not printed."""
    from tests.conftest import load_script

    summarize = load_script("summarize")
    hybrid, original = {"gen_ppl_token": 90.0, "token_entropy": 3.60}, {"gen_ppl_token": 45.0, "token_entropy": 3.55}
    assert summarize.matched_ratio(hybrid, original) == "2.00x (entropies 1.4% apart)"
    hotter = summarize.matched_ratio({**hybrid, "token_entropy": 3.70}, original)
    assert hotter.startswith("not matched: entropies 4.2% apart (over 2%)")


def test_the_summary_gives_the_matched_ratio_a_paired_interval_over_samples():
    """The row's 90% interval resamples the same sample indices for both models: a hybrid writing at twice the
    original's per-token NLL-exp on every sample reads exactly 2x on every resample; independent samples give an
    interval that holds the ratio and agrees with a bootstrap written out here."""
    from tests.conftest import load_script

    summarize = load_script("summarize")
    rng = np.random.default_rng(0)
    n = rng.integers(0, 48, 40)  # some samples score no token and count in neither model's Gen.PPL
    nll = rng.gamma(3.0, 1.3, 40) * n
    rows = lambda model, nll, n: pd.DataFrame({"model": model, "index": range(40), "nll": nll, "n_scored": n})  # noqa: E731
    shifted = pd.concat([rows("original", nll, n), rows("hybrid", nll + np.log(2) * n, n)])
    ppl = {"gen_ppl_token": 2.0, "token_entropy": 3.5}
    assert summarize.matched_ratio(ppl, {**ppl, "gen_ppl_token": 1.0}, per_sample=shifted) == (
        "2.00x (entropies 0.0% apart; 90% over samples 2.00-2.00x)"
    )
    other_n = rng.integers(1, 48, 40)
    other = pd.concat([rows("original", nll, n), rows("hybrid", rng.gamma(3.0, 1.6, 40) * other_n, other_n)])
    lo, hi = summarize.ratio_interval(other)
    hyb, orig = other[other.model == "hybrid"], other[other.model == "original"]
    point = np.exp(hyb.nll.sum() / hyb.n_scored.sum() - orig.nll.sum() / orig.n_scored.sum())
    assert lo < point < hi
    want = []  # the same bootstrap, by hand
    draws = np.random.default_rng(0).integers(0, 40, (1000, 40))
    for idx in draws:
        h, o = hyb.iloc[idx], orig.iloc[idx]
        want.append(np.exp(h.nll.sum() / h.n_scored.sum() - o.nll.sum() / o.n_scored.sum()))
    assert (lo, hi) == pytest.approx(tuple(np.quantile(want, [0.05, 0.95])), rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("builtin", ["smollm2-135m", "gemma3-270m"])
def test_the_plan_estimate_holds_for_both_builtins(builtin, root):
    """The same comparison on the builtins themselves (every layer, their own scales), small."""
    from dihal.stages import extract as stage
    from dihal.stages.configs import DataConfig, ExtractConfig

    cfg = ExtractConfig(model=builtin, data=DataConfig(max_sequences=48))
    estimate = stage.plan(cfg).bytes_estimate
    art = stage.run(cfg, ArtifactStore(root))
    written = dir_size(art.path / "hidden.zarr")
    assert abs(estimate - written) <= 0.1 * written, (estimate, written)
    assert set(art.manifest["metrics"]["store_dtypes"].values()) == {"float16"}

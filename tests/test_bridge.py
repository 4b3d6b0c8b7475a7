"""The bridge: flow loss and sampler on toys, causality, caching, resume, NaN, and the CLI."""

from __future__ import annotations

import signal

import pytest
import torch

from dihal.artifacts.store import ArtifactStore
from dihal.stages import score as sc
from dihal.stages.diffusion import flow
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
from tests.conftest import invoke, run_cli


def _train_toy(y_fn, c_fn, dim, length, steps=400, prediction="x0", width=64, seed=0, batch=256):
    torch.manual_seed(seed)
    net = Denoiser(DenoiserConfig(dim=dim, width=width, depth=2, heads=4, max_len=length))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        c = c_fn(batch, gen)
        y = y_fn(c, gen)
        t = torch.rand(batch, generator=gen)
        eps = torch.randn(y.shape, generator=gen)
        loss = ((net(flow.noisy(y, eps, t), t, c) - flow.training_target(y, eps, prediction)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return net.eval()


@pytest.mark.slow
def test_flow_matching_learns_a_2d_gaussian():
    """Tolerance: mean within 0.1 per coordinate, covariance entries within 0.25 (a short
    training run and Euler steps shrink the spread somewhat; a broken loss or sampler is off
    by far more)."""
    mean = torch.tensor([2.0, -1.0])
    chol = torch.linalg.cholesky(torch.tensor([[1.0, 0.5], [0.5, 0.8]]))
    zeros = lambda b, g: torch.zeros(b, 1, 2)  # no condition
    target = lambda c, g: (mean + torch.randn(c.shape[0], 2, generator=g) @ chol.T)[:, None]
    net = _train_toy(target, zeros, dim=2, length=1, steps=600)
    with torch.no_grad():
        noise = torch.randn(4000, 1, 2, generator=torch.Generator().manual_seed(9))
        c = torch.zeros(4000, 1, 2)
        samples = flow.sample(lambda x, t, i: net(x, t, c), noise, steps=32)[:, 0]
    assert torch.allclose(samples.mean(0), mean, atol=0.1), samples.mean(0)
    cov = torch.cov(samples.T)
    assert torch.allclose(cov, chol @ chol.T, atol=0.25), cov


@pytest.mark.slow
def test_conditional_toy_with_deterministic_map_is_reconstructed():
    w = torch.randn(6, 6, generator=torch.Generator().manual_seed(3)) / 6**0.5
    cond = lambda b, g: torch.randn(b, 8, 6, generator=g)
    target = lambda c, g: torch.tanh(c @ w) * 1.5
    net = _train_toy(target, cond, dim=6, length=8, steps=400, batch=64)
    c = cond(256, torch.Generator().manual_seed(11))
    y = target(c, None)
    with torch.no_grad():
        y_hat = flow.sample(lambda x, t, i: net(x, t, c), torch.randn(y.shape), steps=8)
    rel = float(((y_hat - y) ** 2).sum() / ((y - y.mean((0, 1))) ** 2).sum())
    assert rel < 0.05, rel


def test_denoiser_is_causal_and_cache_matches_full_pass():
    torch.manual_seed(0)
    net = Denoiser(DenoiserConfig(dim=8, width=32, depth=2, heads=4, max_len=16)).eval()
    for p in net.parameters():  # leave adaLN-Zero so attention actually contributes
        torch.nn.init.normal_(p, std=0.2)
    x, c, t = torch.randn(2, 16, 8), torch.randn(2, 16, 8), torch.rand(2)
    with torch.no_grad():
        base = net(x, t, c)
        c2 = c.clone()
        c2[:, 9] += 5.0
        changed = net(x, t, c2)
        assert torch.equal(base[:, :9], changed[:, :9])
        assert not torch.allclose(base[:, 9:], changed[:, 9:])
        caches = net.new_caches()
        pieces = [net(x[:, :5], t, c[:, :5], 0, caches)] + [
            net(x[:, p : p + 1], t, c[:, p : p + 1], p, caches) for p in range(5, 16)
        ]
    torch.testing.assert_close(torch.cat(pieces, 1), base, atol=1e-5, rtol=1e-5)


def test_lr_schedule_warmup_then_cosine_to_zero():
    from dihal.stages.diffusion.trainer import lr_at

    assert lr_at(0, 100, 1.0, 10, "cosine") == pytest.approx(0.1) and lr_at(9, 100, 1.0, 10, "cosine") == 1.0
    assert lr_at(55, 100, 1.0, 10, "cosine") == pytest.approx(0.5) and lr_at(100, 100, 1.0, 10, "cosine") == 0.0
    assert lr_at(70, 100, 1.0, 10, "constant") == 1.0


@pytest.fixture()
def tiny_bridge_extract(tiny_dirs, root):
    return make_tiny_extract(tiny_dirs, root)


def make_tiny_extract(tiny_dirs, root):
    """40 sequences of 16 tokens of the tiny llama, every layer, in `root` (the current store)."""
    res = invoke(
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--max-sequences",
        "40",
        "--seq-len",
        "16",
        "--val-fraction",
        "0.2",
        "--device",
        "cpu",
    )
    assert res.exit_code == 0, res.output
    return root


TINY = ["--protocol", "sweep-tiny", "--width", "32", "--depth", "2", "--heads", "4", "--batch-size", "8"]


@pytest.mark.slow
def test_train_bridge_writes_weights_metrics_plot(tiny_bridge_extract):
    from dihal.artifacts import files

    res = invoke(
        "train-bridge", "--layer", "2", "--extract", "latest", *TINY, "--train-steps", "12", "--eval-every", "6"
    )
    assert res.exit_code == 0, res.output
    art = ArtifactStore(tiny_bridge_extract).resolve("latest", "bridge")
    rows = files.read_jsonl(art.file("metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["step"] for r in rows if "val_loss" in r] == [6, 12]
    assert art.manifest["metrics"]["val_loss"] == rows[-1]["val_loss"]
    for name in (
        "weights.safetensors",
        "weights_ema.safetensors",
        "stats.safetensors",
        "loss_curve.png",
        "bridge.json",
    ):
        assert art.file(name).exists(), name
    assert not art.file("state.safetensors").exists()
    assert art.manifest["config"]["protocol"] == "sweep-tiny" and art.manifest["config"]["steps"] == 12
    again = invoke(
        "train-bridge", "--layer", "2", "--extract", "latest", *TINY, "--train-steps", "12", "--eval-every", "6"
    )
    assert "cache hit" in again.output
    fid = invoke("evaluate", "--bridge", art.id, "--sample-steps", "1,4", "--limit", "8", "--json")
    assert fid.exit_code == 0, fid.output
    import json

    rows = json.loads(fid.output)["results"]
    assert [r["steps"] for r in rows] == [1, 4]
    for r in rows:
        assert 0 <= r["top1_agreement"] <= 1 and -1 <= r["cosine"] <= 1 and r["kl"] >= 0 and r["ppl_original"] > 1


@pytest.mark.slow
def test_out_init_zero_starts_the_bridge_at_its_skip_and_names_a_new_bridge(tiny_bridge_extract):
    """--out-init zero (issue 66, DiT's zeroed output layer): after one step at a negligible rate the output layer
    is still zero to within the step, so the bridge's output is A c whatever x_t; plain keeps PyTorch's init and
    its id stays the one every bridge before the option had (the option is not hashed at its default)."""
    import torch

    from dihal.artifacts import files

    base = ["train-bridge", "--layer", "2", "--extract", "latest", *TINY, "--train-steps", "1", "--lr", "1e-9"]
    store, outs = ArtifactStore(tiny_bridge_extract), {}
    for init in ("plain", "zero"):
        res = invoke(*base, "--out-init", init)
        assert res.exit_code == 0, res.output
        art = store.resolve("latest", "bridge")
        outs[init] = (art, files.load_tensors(art.file("weights.safetensors"))["out.weight"])
    assert outs["plain"][1].abs().max() > 1e-3 and outs["zero"][1].abs().max() < 1e-7
    assert outs["plain"][0].id != outs["zero"][0].id
    assert "out_init" not in outs["plain"][0].manifest["config"]
    assert outs["zero"][0].manifest["config"]["out_init"] == "zero"
    assert invoke(*base).output.count("cache hit") == 1  # no option: the plain bridge, reused
    from dihal.stages.parts.bridge import Bridge

    bridge = Bridge.load(outs["zero"][0], weights="final")
    c, t = torch.randn(2, 15, bridge.net.cfg.dim), torch.tensor([0.2, 0.9])
    out = bridge.net(torch.randn(2, 15, bridge.net.cfg.dim), t, c)
    assert torch.allclose(out, bridge.net.skip(c), atol=1e-5)
    bad = invoke(*base, "--out-init", "xavier")
    assert bad.exit_code == 2 and "unknown --out-init 'xavier'" in bad.output


@pytest.mark.slow
def test_keep_weights_keeps_the_ema_alone_rounded_and_the_hybrid_reads_it(tiny_bridge_extract):
    """issue 64's disk: --keep-weights ema-bfloat16 trains the same network (every logged loss but the last
    validation equal), keeps the EMA weights alone, the float32 run's rounded to bfloat16 bit for bit, at a
    quarter of the bytes; the last validation is of the rounded weights; evaluate samples with them; the final
    weights it did not keep are refused in one line."""
    import torch

    from dihal.artifacts import files
    from dihal.artifacts.errors import DihalError
    from dihal.stages.parts.bridge import Bridge

    args = ["train-bridge", "--layer", "2", "--extract", "latest", *TINY, "--train-steps", "12", "--eval-every", "6"]
    arts = []
    for extra in ([], ["--keep-weights", "ema-bfloat16"]):
        res = invoke(*args, *extra)
        assert res.exit_code == 0, res.output
        arts.append(ArtifactStore(tiny_bridge_extract).resolve("latest", "bridge"))
    both, lean = arts
    assert both.id != lean.id and lean.config["keep_weights"] == "ema-bfloat16" and "keep_weights" not in both.config
    assert not lean.file("weights.safetensors").exists() and both.file("weights.safetensors").exists()
    full, rounded = (files.load_tensors(a.file("weights_ema.safetensors")) for a in arts)
    assert full.keys() == rounded.keys()
    for name, value in full.items():
        assert rounded[name].dtype == torch.bfloat16 and torch.equal(rounded[name], value.to(torch.bfloat16)), name
    size = lambda a: sum(a.file(n).stat().st_size for n in ("weights.safetensors", "weights_ema.safetensors"))
    assert lean.file("weights_ema.safetensors").stat().st_size < 0.26 * size(both)
    logs = [files.read_jsonl(a.file("metrics.jsonl")) for a in arts]
    assert [r["train_loss"] for r in logs[0]] == [r["train_loss"] for r in logs[1]]
    assert logs[0][5]["val_loss"] == logs[1][5]["val_loss"] and logs[0][-1]["val_loss"] != logs[1][-1]["val_loss"]
    assert abs(logs[1][-1]["val_loss"] / logs[0][-1]["val_loss"] - 1) < 0.05
    fid = invoke("evaluate", "--bridge", lean.id, "--sample-steps", "2", "--limit", "8")
    assert fid.exit_code == 0, fid.output
    with pytest.raises(DihalError, match="EMA weights alone"):
        Bridge.load(lean, weights="final")
    bad = invoke(*args, "--keep-weights", "final")
    assert bad.exit_code == 2 and "final+ema, ema, ema-bfloat16" in bad.output and bad.output.count("\n") == 1


@pytest.mark.slow
def test_resume_after_kill_gives_identical_weights(tiny_bridge_extract, tmp_path):
    from dihal.artifacts import files

    args = [
        "train-bridge",
        "--layer",
        "2",
        "--extract",
        "latest",
        *TINY,
        "--train-steps",
        "30",
        "--eval-every",
        "10",
        "--checkpoint-every",
        "5",
        "--root",
        str(tiny_bridge_extract),
    ]
    killed = run_cli(*args, kill_after=23)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    store = ArtifactStore(tiny_bridge_extract)
    partial = store.all("bridge")[0]
    assert partial.status == "running" and files.load_state(partial.path)["step"] == 20
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming bridge L2 training at step 20" in resumed.stderr
    resumed_w = files.load_tensors(store.load("bridge", partial.id).file("weights_ema.safetensors"))
    fresh = run_cli(*args, "--force")
    assert fresh.returncode == 0
    fresh_w = files.load_tensors(store.load("bridge", partial.id).file("weights_ema.safetensors"))
    for name in fresh_w:
        assert torch.equal(resumed_w[name], fresh_w[name]), name
    log = files.read_jsonl(store.load("bridge", partial.id).file("metrics.jsonl"))
    assert [r["step"] for r in log] == list(range(1, 31))


def test_nan_loss_stops_with_clear_message(tiny_bridge_extract):
    res = invoke(
        "train-bridge",
        "--layer",
        "2",
        "--extract",
        "latest",
        *TINY,
        "--train-steps",
        "30",
        "--lr",
        "1e30",
        "--warmup",
        "1",
    )
    assert res.exit_code == 2 and "bridge L2 loss became nan" in res.output, res.output
    assert ArtifactStore(tiny_bridge_extract).all("bridge")[0].status == "failed"


def test_bridge_errors(tiny_bridge_extract):
    res = invoke("train-bridge", "--layer", "2", "--extract", "latest", "--protocol", "huge")
    assert res.exit_code == 2 and "unknown --protocol" in res.output
    res = invoke("evaluate", "--bridge", "doesnotexist")
    assert res.exit_code == 2 and "no bridge artifact 'doesnotexist'" in res.output


def test_trained_parts_name_the_layer_their_extract_lacks(tiny_dirs, root):
    res = invoke("extract", "--model", str(tiny_dirs["llama"]), "--layers", "0,2", "--max-sequences", "8")
    assert res.exit_code == 0, res.output
    for stage in ("train-bridge", "train-prior"):
        res = invoke(stage, "--layer", "3", "--extract", "latest", *TINY, "--train-steps", "2")
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
        assert "lacks layer 3 (it holds [0, 2])" in res.output and "--layers 0,3" in res.output, res.output
    assert not ArtifactStore(root).all("bridge") and not ArtifactStore(root).all("prior")


@pytest.mark.slow
def test_sweep_over_tiny_model_writes_table_rho_plot(tiny_dirs, root):
    import json

    import numpy as np
    import pandas as pd
    from scipy.stats import spearmanr

    ok = invoke(
        "extract",
        "--model",
        str(tiny_dirs["gemma3"]),
        "--max-sequences",
        "40",
        "--seq-len",
        "16",
        "--val-fraction",
        "0.2",
        "--device",
        "cpu",
    )
    assert ok.exit_code == 0, ok.output
    res = invoke(
        "sweep",
        "--layers",
        "1,2,3",
        "--extract",
        "latest",
        "--tokens",
        "200",
        "--train-steps",
        "6",
        "--width",
        "32",
        "--depth",
        "1",
        "--batch-size",
        "8",
        "--eval-limit",
        "4",
        "--seeds",
        "0,1",
        "--bootstrap",
        "2",
        "--device",
        "cpu",
    )
    assert res.exit_code == 0, res.output
    assert "which predictor" in res.output and "-depth (baseline)" in res.output
    store = ArtifactStore(root)
    art = store.resolve("latest", "sweep")
    shown = pd.read_csv(art.file("variants.csv")).set_index("variant").loc["S"]
    line = next(x for x in res.output.splitlines() if x.strip().startswith("S  "))  # whole at 80 columns
    assert f"{shown['rho']:.3f}" in line and f"{shown['kendall_tau']:.3f}" in line and "…" not in line, line
    table = pd.read_csv(art.file("sweep.csv"))
    runs = pd.read_csv(art.file("sweep_runs.csv"))
    assert table["layer"].tolist() == [1, 2, 3] and sorted(runs["seed"].unique()) == [0, 1] and len(runs) == 6
    assert len(store.all("bridge")) == 6 and art.file("sweep.png").stat().st_size > 1000
    by_layer = runs.groupby("layer")["val_loss"]
    np.testing.assert_allclose(table["val_loss"], by_layer.mean().to_numpy())
    np.testing.assert_allclose(table["val_loss_std"], by_layer.std(ddof=1).to_numpy())
    summary = json.loads(art.file("summary.json").read_text())
    rho, p = spearmanr(table["S"], -table["val_loss"])
    assert summary["spearman_rho"] == pytest.approx(rho) and summary["p_value"] == pytest.approx(p)
    assert summary["oracle_layer"] == int(table.loc[table.val_loss.idxmin(), "layer"])
    assert summary["worst_layer"] == int(table.loc[table.val_loss.idxmax(), "layer"])
    per_seed = {str(s): int(g.loc[g.val_loss.idxmin(), "layer"]) for s, g in runs.groupby("seed")}
    assert summary["oracle_per_seed"] == per_seed
    assert summary["oracle_agreement"] == np.mean([o == summary["oracle_layer"] for o in per_seed.values()])
    variants = pd.read_csv(art.file("variants.csv")).set_index("variant")
    assert list(variants.index) == [
        "S",
        "m_curv alone",
        "m_mono alone",
        "-k_hat alone",
        "r2_token alone",
        "r2_context alone",
        "S, normalize=rms",
        "S, normalize=standardize",
        "-depth (baseline)",
    ]
    assert variants.loc["S", "rho"] == pytest.approx(rho)
    scores = sc.load_table(store.resolve(art.manifest["parents"]["score"], "score")).set_index("layer")
    for proxy in ("r2_token", "r2_context"):  # dihal's own proxies rank the layers like every other
        own = spearmanr(scores.loc[table["layer"], proxy], -table["val_loss"])[0]
        assert variants.loc[f"{proxy} alone", "rho"] == pytest.approx(own)
    assert variants.loc["-depth (baseline)", "rho"] == pytest.approx(spearmanr(-table["layer"], -table["val_loss"])[0])
    assert (
        variants.loc["S", "resampled"] == "seeds+positions"
        and variants.loc["-depth (baseline)", "resampled"] == "seeds"
    )
    assert (variants["rho_lo"] <= variants["rho_hi"]).all()
    rms = store.resolve(summary["variant_scores"]["rms"], "score")
    assert (
        rms.manifest["config"]["normalize"] == "rms"
        and rms.manifest["parents"]["extract"] == art.manifest["parents"]["extract"]
    )
    again = invoke(
        "sweep",
        "--layers",
        "1,2,3",
        "--extract",
        "latest",
        "--tokens",
        "200",
        "--train-steps",
        "6",
        "--width",
        "32",
        "--depth",
        "1",
        "--batch-size",
        "8",
        "--eval-limit",
        "4",
        "--seeds",
        "0,1",
        "--bootstrap",
        "2",
        "--device",
        "cpu",
    )
    assert again.exit_code == 0 and len(store.all("bridge")) == 6  # bridges reused through the cache


def test_partial_spearman_and_window_correlations_against_plain_computations():
    import numpy as np
    from scipy.stats import kendalltau, spearmanr

    from dihal.stages import sweep

    rng = np.random.default_rng(3)
    layers = np.arange(1, 16)
    neg_loss = -(0.1 * layers + rng.normal(scale=0.5, size=15))
    x = -layers + rng.normal(scale=2.0, size=15)
    # partial Spearman: correlate the residuals of the ranks regressed on the depth ranks
    ranks = [np.argsort(np.argsort(v)).astype(float) for v in (x, neg_loss, layers)]
    design = np.c_[np.ones(15), ranks[2]]
    resid = [r - design @ np.linalg.lstsq(design, r, rcond=None)[0] for r in ranks[:2]]
    expected = np.corrcoef(*resid)[0, 1]
    assert sweep.partial_spearman(x, neg_loss, layers) == pytest.approx(expected, abs=1e-12)
    shallow = layers <= sweep.shallow_top(15)
    out = sweep.correlations(x, neg_loss, layers, shallow)
    assert sweep.shallow_top(15) == 5 and out["n_shallow"] == 5
    assert out["rho_shallow"] == pytest.approx(spearmanr(x[:5], neg_loss[:5])[0])
    assert out["kendall_tau"] == pytest.approx(kendalltau(x, neg_loss)[0])
    assert out["rho"] == pytest.approx(spearmanr(x, neg_loss)[0])
    assert np.isnan(sweep.partial_spearman(-layers + 0.0, neg_loss, layers))  # depth given depth: undefined


def test_the_ema_is_the_per_tensor_update_to_the_bit():
    """EMA.update runs as two foreach kernels (issue 64); each tensor gets d * ema + (1 - d) * w exactly as the
    per-tensor loop it replaced computed it."""
    from dihal.stages.diffusion.trainer import EMA

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))
    ema = EMA(net, 0.999)
    loop = {k: v.clone() for k, v in ema.params.items()}
    for step in range(5):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        ema.update(net, step)
        d = min(0.999, (1 + step) / (10 + step))
        for k, v in net.state_dict().items():
            loop[k].mul_(d).add_(v, alpha=1 - d)
    assert all(torch.equal(ema.params[k], loop[k]) for k in loop)
    assert not torch.equal(ema.params["0.weight"], net.state_dict()["0.weight"])

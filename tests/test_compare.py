"""The comparison of docs/method.md section 5: the prior, the recoveries, shared noise, bad input,
and `dihal compare` end to end on a tiny model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dihal.artifacts.store import ArtifactStore, Job
from dihal.stages.configs import GenerateConfig
from dihal.stages.diffusion import flow
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
from dihal.stages.diffusion.draws import ItemDraws
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.lm.vocab import embedding_table, nearest, rounding
from dihal.stages.parts.autoencoder import Autoencoder, latents_of
from dihal.stages.parts.decoder import Decoder
from dihal.stages.parts.prior import Prior
from dihal.stages.train_prior import PriorTask
from tests.conftest import ROOT as REPO
from tests.conftest import build_tiny, invoke, shared

TEMPLATES = torch.tensor(
    [
        [[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0]],
        [[0.0, -2.0], [2.0, 2.0], [-2.0, -2.0]],
        [[-2.0, 2.0], [2.0, -2.0], [0.0, 0.0]],
    ]
)  # 3 sequences of 3 positions in 2-D


def _toy_extract(path) -> object:
    """The three templates as an extract's layer 0 (position 0 zero), 4 of each: 9 train, 3 validation."""
    from dihal.artifacts import hidden_states as hs

    states = torch.cat([torch.zeros(12, 1, 2), TEMPLATES.repeat(4, 1, 1)], dim=1).numpy()
    group = hs.create(path, layers=[0], n_seq=12, seq_len=4, width=2, dtypes={0: "float32"}, chunk_seqs=4, attrs={})
    group["layers/0"][:] = states
    group["split"][:] = np.array([0] * 9 + [1] * 3, dtype=np.int8)
    return group


def _toy_prior(self_condition: bool, steps: int = 500):
    """A prior trained on a mixture of three fixed sequences with the comparison's own loss (PriorTask's,
    built as the stage builds it, on an extract of the templates at unit statistics)."""
    import tempfile

    from dihal.stages.configs import PriorConfig

    torch.manual_seed(0)
    net = Denoiser(
        DenoiserConfig(
            dim=2, width=64, depth=2, heads=4, max_len=3, causal=False, condition=False, self_condition=self_condition
        )
    )
    norm = Normalizer(torch.zeros(2), torch.ones(2), torch.zeros(2), torch.ones(2), torch.zeros(2))
    cfg = PriorConfig.for_run(
        "compare-cpu", {}, layer=0, self_condition=self_condition, seed=0, device="cpu", dtype="float32"
    )
    with tempfile.TemporaryDirectory() as tmp:
        task = PriorTask(_toy_extract(Path(tmp) / "h.zarr"), cfg, norm)
        torch.testing.assert_close(task.y_val, TEMPLATES)  # positions 1..3 of the validation sequences
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        pick = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(step))
        raw = torch.cat([torch.zeros(64, 1, 2), TEMPLATES[pick]], dim=1).numpy()  # position 0 is dropped
        loss = task.loss(net, {"y": raw}, ItemDraws(7, step, np.arange(64)), torch.device("cpu")) / 64
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return Prior(net.eval(), norm, 0, self_condition, 4), losses


@pytest.mark.slow
def test_prior_samples_land_on_the_toy_sequences_and_its_loss_falls():
    """Tolerance: 90% of samples within 0.5 (L2, whole sequence) of a template, the spread of the
    mixture being 2; the x0 loss of the last 50 steps at most half that of the first 50."""
    prior, losses = _toy_prior(False)
    assert np.mean(losses[-50:]) < 0.5 * np.mean(losses[:50])
    samples = prior.sample(300, steps=30, seed=4)
    dist = torch.cdist(samples.reshape(300, -1), TEMPLATES.reshape(3, -1)).min(1).values
    assert (dist < 0.5).float().mean() > 0.9, dist.quantile(torch.tensor([0.5, 0.9]))
    hits = torch.cdist(samples.reshape(300, -1), TEMPLATES.reshape(3, -1)).argmin(1).bincount(minlength=3)
    assert hits.min() > 50  # every mode is found, none dropped


@pytest.mark.slow
def test_self_conditioning_feeds_the_previous_estimate_and_clamping_lands_on_the_table():
    prior, _ = _toy_prior(True, steps=300)
    x, t = torch.randn(5, 3, 2), torch.full((5,), 0.7)
    with torch.no_grad():
        plain, fed = prior.net(x, t, x0_prev=torch.zeros_like(x)), prior.net(x, t, x0_prev=TEMPLATES[[0, 1, 2, 0, 1]])
    assert not torch.allclose(plain, fed, atol=1e-3)  # the network learned to use the estimate it is given
    assert prior.net.in_sc.weight.abs().sum() > 0
    table = TEMPLATES.reshape(-1, 2)[[0, 1, 3, 4, 5, 6]]  # clamping: every x0 estimate snaps onto a row's ray
    unit = torch.nn.functional.normalize(table, dim=-1)

    def best_cosine(x):
        return (torch.nn.functional.normalize(x.reshape(-1, 2), dim=-1) @ unit.T).max(1).values

    clamped = prior.sample(40, steps=10, seed=1, clamp_to=table)
    assert (best_cosine(clamped) > 1 - 1e-5).all()
    free = prior.sample(40, steps=10, seed=1)
    assert not (best_cosine(free) > 1 - 1e-5).all()


@pytest.mark.slow
def test_prior_conditions_are_the_priors_own_estimates_from_noise_up_to_t():
    """prior:T: from t near 0 the toy prior gives its data back; from t up to 1 its estimates stray
    further (it must guess the template); the draws repeat with the generators' seeds."""
    prior, _ = _toy_prior(False, steps=300)
    raw = TEMPLATES[[0, 1, 2, 0, 1, 2]]
    gens = lambda: ItemDraws(0, 0, np.arange(6))
    near = prior.corrupt(raw, 1e-3, gens())
    far = prior.corrupt(raw, 1.0, gens())
    assert (near - raw).abs().max() < 0.3
    assert (far - raw).norm(dim=-1).mean() > 3 * (near - raw).norm(dim=-1).mean()
    torch.testing.assert_close(prior.corrupt(raw, 1.0, gens()), far)
    assert not far.requires_grad


def test_prior_noise_depends_on_seed_and_sample_index_only():
    prior, _ = _toy_prior(False, steps=20)
    a, b = prior.sample(7, 5, seed=3, batch=2), prior.sample(7, 5, seed=3, batch=7)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, prior.sample(7, 5, seed=4))


def test_nearest_is_the_highest_cosine_by_brute_force():
    gen = torch.Generator().manual_seed(0)
    table, x = torch.randn(500, 8, generator=gen), torch.randn(3, 70, 8, generator=gen)
    cos = (x[..., None, :] * table).sum(-1) / (x.norm(dim=-1)[..., None] * table.norm(dim=-1))
    assert torch.equal(nearest(x, table, rows=16), cos.argmax(-1))


def test_cosine_rounding_recovers_shrunk_embeddings_where_l2_collapses_to_hubs():
    """An x0-predictor at high noise emits about 0.1 e. By L2 (the old rule, in the normalized space)
    those land on the few small-norm rows; by cosine on the raw table each returns its own token."""

    gen = torch.Generator().manual_seed(3)
    table = torch.randn(400, 16, generator=gen) * torch.rand(400, 1, generator=gen).mul(3).add(0.2)
    table += 0.5  # a shared offset, as real embedding tables have
    mu, sigma = table.mean(0), table.std(0)
    ids = torch.randint(0, 400, (8, 25), generator=gen)
    shrunk = (0.1 * table[ids] - mu) / sigma  # what rounding receives: normalized
    assert torch.equal(rounding(shrunk, table, mu, sigma), ids)
    table_n = (table - mu) / sigma
    by_l2 = ((shrunk[..., None, :] - table_n) ** 2).sum(-1).argmin(-1)
    assert (by_l2 == ids).float().mean() < 0.2 and by_l2.unique().numel() < ids.unique().numel() / 3


def test_rounding_clean_embeddings_recovers_the_tokens_exactly():

    model, _ = build_tiny("gemma3")  # Gemma scales its embeddings by sqrt(d): the table must too
    table = embedding_table(model, batch=50)
    ids = torch.randint(3, model.config.vocab_size, (4, 15), generator=torch.Generator().manual_seed(1))
    from dihal.stages.lm.capture import hidden_states

    h0 = hidden_states(model, ids, [0])[0]
    mu, sigma = h0.reshape(-1, h0.shape[-1]).mean(0), h0.reshape(-1, h0.shape[-1]).std(0)
    assert torch.equal(rounding((h0 - mu) / sigma, table, mu, sigma), ids)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hidden_recovery_with_the_true_states_gives_the_original_greedy_tokens(kind):
    from dihal.stages import recover
    from dihal.stages.lm.hybrid import original_forward, suffix_model

    model, _ = build_tiny(kind)
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = 1
    _, states = original_forward(model, ids, [2])
    tokens = recover.upper_argmax(model, suffix_model(model, 2), states[2], rows=5)
    with torch.no_grad():
        greedy = model(input_ids=ids, use_cache=False).logits.argmax(-1)[:, :-1]
    assert torch.equal(tokens, greedy)


@pytest.mark.slow
def test_decoder_learns_the_toy_set_to_99_percent(tiny_dirs, root):
    from dihal.stages import train_decoder as dec

    assert (
        invoke(
            "extract",
            "--model",
            str(tiny_dirs["llama"]),
            "--max-sequences",
            "12",
            "--seq-len",
            "12",
            "--layers",
            "0",
            "--val-fraction",
            "0.25",
            "--device",
            "cpu",
        ).exit_code
        == 0
    )
    store = ArtifactStore(root)
    ex = store.resolve("latest", "extract")
    cfg = dec.DecoderTrainConfig.from_protocol(
        "sweep-tiny", steps=250, width=64, heads=4, batch_size=9, lr=3e-3, condition_noise=0.0
    )
    art = dec.run(cfg, ex, store)
    m = art.manifest["metrics"]
    assert m["parameters"] > 0 and m["tokens_seen"] == 250 * 9 * 11
    net = json.loads(art.file("decoder.json").read_text())["decoder"]
    assert m["frozen_parameters"] == net["vocab"] * net["dim"]  # the backbone's table, frozen
    weights = __import__("dihal.artifacts.files", fromlist=["x"]).load_tensors(art.file("weights_ema.safetensors"))
    assert not any(t.shape[0] == net["vocab"] for t in weights.values())  # no V-way table is trained or saved
    from dihal.artifacts import hidden_states as hs

    group = hs.open_group(ex)
    train = hs.split_indices(group, "train")
    norm = Normalizer(**__import__("dihal.artifacts.files", fromlist=["x"]).load_tensors(art.file("stats.safetensors")))
    e = norm.c(torch.from_numpy(hs.read_sequences(group, 0, train)[:, 1:].astype(np.float32)))
    ids = torch.from_numpy(np.asarray(group["input_ids"].oindex[train])[:, 1:].astype(np.int64))
    table = embedding_table(__import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]))
    tokens = Decoder.load(art, table).tokens(e)
    assert (tokens == ids).float().mean() >= 0.99


def test_condition_noise_corrupts_per_sequence_within_sigma_max():
    c = torch.zeros(200, 30, 4)
    noisy = flow.corrupt(c, 0.5, ItemDraws(0, 0, np.arange(200)))
    per_seq_std = noisy.std(dim=(1, 2))
    assert (
        per_seq_std.max() < 0.5 * 1.3
        and per_seq_std.min() < 0.05
        and per_seq_std.mean() == pytest.approx(0.25, abs=0.04)
    )
    assert torch.equal(flow.corrupt(c, 0.0, ItemDraws(0, 0, np.arange(200))), c)


def ok(res) -> None:
    """A CLI call that must succeed; its output is the failure message."""
    if res.exit_code != 0:
        pytest.fail(res.output)


def tiny_extract(tiny_dirs) -> list[str]:
    """The tiny llama extract the CLI tests below start from: 16 sequences of 12 tokens, a quarter held out."""
    return ["extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "16", "--seq-len", "12"] + [
        "--val-fraction",
        "0.25",
        "--device",
        "cpu",
    ]


# -- through the CLI -----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def parts_store(tiny_dirs, tmp_path_factory):
    """A store with a tiny llama extract, a prior over h_0, a noisy-condition bridge at layer 2 and a
    decoder, made once per session for all workers; `parts` hands each test a copy of it."""

    def build(folder):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DIHAL_ROOT", str(folder / "runs"))
            make_parts(tiny_dirs)

    return shared(tmp_path_factory, "parts", build) / "runs"


@pytest.fixture()
def parts(parts_store, root):
    """The session's parts, copied into this test's store (tests write to it)."""
    shutil.copytree(parts_store, root)
    store = ArtifactStore(root)
    return {k: store.resolve("latest", k) for k in ("extract", "prior", "bridge", "decoder")}


def make_parts(tiny_dirs) -> None:
    small = ["--train-steps", "3", "--width", "16", "--batch-size", "4"]
    ok(invoke(*tiny_extract(tiny_dirs)))
    ok(invoke("train-prior", *small, "--depth", "1", "--heads", "2"))
    ok(
        invoke(
            "train-bridge",
            "--layer",
            "2",
            "--extract",
            "latest",
            *small,
            "--depth",
            "1",
            "--heads",
            "2",
            "--condition-noise",
            "0.5",
        )
    )
    ok(invoke("train-decoder", *small, "--heads", "2"))


def test_too_few_held_out_sequences_for_the_oracle_fail_before_the_model_loads(parts, root, no_model_loads):
    res = invoke(
        "generate",
        "--mode",
        "parallel",
        "--prior",
        parts["prior"].id,
        "--source",
        "oracle",
        "--num-samples",
        "50",
        "--device",
        "cpu",
    )
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.output.strip().splitlines()[-1] == (
        f"error: --source oracle reads held-out sequences, but extract {parts['extract'].id} has 4 validation "
        "sequences; use --num-samples 4 or fewer, or extract with a larger --val-fraction"
    )


@pytest.mark.slow
def test_rows_that_share_a_prior_and_seed_share_its_samples(parts, root):
    common = [
        "generate",
        "--mode",
        "parallel",
        "--prior",
        parts["prior"].id,
        "--num-samples",
        "5",
        "--prior-steps",
        "3",
        "--sample-steps",
        "2",
        "--batch-size",
        "2",
        "--device",
        "cpu",
    ]
    from dihal.stages import generate_parallel

    runs = {"rounding": [], "decoder": ["--decoder", parts["decoder"].id], "hidden": ["--bridge", parts["bridge"].id]}
    digests, reused = {}, []
    store = ArtifactStore(root)
    generate_parallel._PRIOR_SAMPLES.clear()
    for recovery, extra in runs.items():
        res = invoke(*common, "--recovery", recovery, *extra)
        assert res.exit_code == 0, res.output
        art = store.resolve("latest", "generate")
        digests[recovery] = art.manifest["metrics"]["prior_samples_sha256"]
        reused.append(art.manifest["metrics"]["prior_samples_reused"])
        rows = [json.loads(line) for line in art.file("samples.jsonl").read_text().splitlines()]
        assert len(rows) == 5 and all(len(r["token_ids"]) <= 11 and r["prompt"] == "" for r in rows)
    assert len(set(digests.values())) == 1
    assert reused == [False, True, True]  # the prior was integrated once, for the first row
    kept = art.file("samples.jsonl").read_text()
    generate_parallel._PRIOR_SAMPLES.clear()  # integrated afresh, the hidden row's samples and tokens are the same
    assert invoke(*common, "--recovery", "hidden", *runs["hidden"], "--force").exit_code == 0
    again = store.resolve("latest", "generate")
    assert not again.manifest["metrics"]["prior_samples_reused"]
    assert again.manifest["metrics"]["prior_samples_sha256"] == digests["hidden"]
    assert again.file("samples.jsonl").read_text() == kept
    other = invoke(*common, "--recovery", "rounding", "--seed", "1")
    assert (
        other.exit_code == 0
        and store.resolve("latest", "generate").manifest["metrics"]["prior_samples_sha256"] != digests["rounding"]
    )


def test_parts_trained_on_the_priors_estimates_record_it_and_refuse_bad_specs(parts, root):
    store = ArtifactStore(root)
    small = ["--train-steps", "2", "--width", "16", "--batch-size", "4", "--heads", "2"]
    res = invoke("train-decoder", *small, "--condition-noise", "prior:0.5", "--prior", parts["prior"].id)
    assert res.exit_code == 0, res.output
    dec = store.resolve("latest", "decoder")
    assert dec.manifest["parents"]["prior"] == parts["prior"].id and dec.config["condition_from"] == "prior"
    res = invoke(
        "train-bridge",
        "--layer",
        "2",
        "--extract",
        "latest",
        *small,
        "--depth",
        "1",
        "--condition-noise",
        "prior:0.5",
        "--prior",
        parts["prior"].id,
    )
    assert res.exit_code == 0, res.output
    assert store.resolve("latest", "bridge").manifest["parents"]["prior"] == parts["prior"].id
    for spec, extra, needle in (
        ("prior:0.5", [], "needs --prior ID"),
        ("prior:1.5", ["--prior", parts["prior"].id], "noise time T in (0, 1]"),
        ("prior:x", [], "cannot read --condition-noise"),
        ("blur:0.5", [], "use prior:T or sigma:S"),
        ("sigma:nan", [], "must be finite"),
        ("sigma:0.5", ["--prior", parts["prior"].id], "--prior is for --condition-noise prior:T"),
    ):
        res = invoke("train-decoder", *small, "--condition-noise", spec, *extra)
        assert res.exit_code == 2 and res.output.strip().splitlines()[-1].startswith("error: "), (spec, res.output)
        assert needle in res.output, (spec, res.output)


@pytest.mark.slow
def test_ld4lg_autoencoder_reconstructs_through_its_latents_and_its_prior_feeds_the_decoder(tiny_dirs, root):
    """The resampler + frozen-table decoder learns the toy train set through 4 x 16 latents; the prior
    over those latents trains on them; generate reads them (prior, oracle, null); a wrong pairing is
    one error line."""
    import transformers

    from dihal.artifacts import files
    from dihal.artifacts import hidden_states as hs
    from dihal.stages import train_autoencoder as latent

    ok(invoke(*tiny_extract(tiny_dirs)))
    store = ArtifactStore(root)
    ex = store.resolve("latest", "extract")
    cfg = latent.AutoencoderConfig.from_protocol(
        "sweep-tiny", steps=150, width=64, heads=4, batch_size=12, lr=3e-3, latents=4, latent_dim=16
    )
    ae = latent.run(cfg, ex, store)
    group = hs.open_group(ex)
    train = hs.split_indices(group, "train")
    ids = torch.from_numpy(np.asarray(group["input_ids"].oindex[train])[:, 1:].astype(np.int64))
    z = latents_of(ae, "train")
    assert z.shape == (len(train), 4, 16)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    tokens = Autoencoder(ae, embedding_table(model)).tokens(z)
    assert (tokens == ids).float().mean() >= 0.95
    m = ae.manifest["metrics"]
    assert 0 <= m["reconstruction_accuracy"] <= 1 and m["encoder_layer"] == max(hs.stored_layers(group))
    weights = files.load_tensors(ae.file("weights_ema.safetensors"))
    assert not any(t.shape[0] == model.config.vocab_size for t in weights.values())  # the table stays frozen
    small = ["--train-steps", "3", "--width", "16", "--depth", "1", "--heads", "2"]
    ok(invoke("train-prior", "--latents", ae.id, *small))
    prior = store.resolve("latest", "prior")
    assert prior.manifest["parents"]["autoencoder"] == ae.id
    base = ["generate", "--mode", "parallel", "--prior", prior.id, "--num-samples", "3", "--prior-steps", "2"]
    for source in ("prior", "oracle", "null"):
        ok(invoke(*base, "--recovery", "latent", "--autoencoder", ae.id, "--source", source, "--device", "cpu"))
        rows = _samples(store.resolve("latest", "generate"))
        assert len(rows) == 3 and all(len(r) <= 11 for r in rows)
    res = invoke(*base, "--recovery", "rounding")
    assert res.exit_code == 2 and "use --recovery latent --autoencoder ID" in res.output


@pytest.mark.slow
def test_bad_parallel_requests_are_one_line(parts, tiny_dirs, root):
    def refused(res, needle):
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert res.output.strip().splitlines()[-1].startswith("error: ") and needle in res.output, res.output

    base = ["generate", "--mode", "parallel", "--prior", parts["prior"].id, "--device", "cpu"]
    refused(invoke(*base, "--recovery", "hidden"), "--recovery hidden needs --bridge ID")
    refused(invoke(*base, "--recovery", "decoder"), "--recovery decoder needs --decoder ID")
    refused(invoke("generate", "--mode", "parallel", "--device", "cpu"), "--mode parallel needs --prior ID")
    refused(invoke(*base, "--prompt", "The"), "leave out --prompt")
    # a bridge of another model (and seq_len) than the prior's
    assert (
        invoke(
            "extract",
            "--model",
            str(tiny_dirs["gemma3"]),
            "--max-sequences",
            "16",
            "--seq-len",
            "10",
            "--layers",
            "0,2",
            "--val-fraction",
            "0.25",
            "--device",
            "cpu",
        ).exit_code
        == 0
    )
    assert (
        invoke(
            "train-bridge",
            "--layer",
            "2",
            "--extract",
            "latest",
            "--train-steps",
            "2",
            "--width",
            "16",
            "--depth",
            "1",
            "--heads",
            "2",
            "--batch-size",
            "4",
        ).exit_code
        == 0
    )
    foreign = ArtifactStore(root).resolve("latest", "bridge")
    refused(invoke(*base, "--recovery", "hidden", "--bridge", foreign.id), "use parts of the same model and seq_len")
    refused(invoke("train-prior", "--train-steps", "0"), "--train-steps must be at least 1")


COMPARE = [
    "compare",
    "--max-sequences",
    "48",
    "--seq-len",
    "12",
    "--seeds",
    "0,1",
    "--num-samples",
    "4",
    "--prior-steps",
    "3",
    "--sample-steps",
    "2",
    "--train-steps",
    "3",
    "--width",
    "16",
    "--depth",
    "1",
    "--tokens",
    "150",
    "--temperatures",
    "0,1",
    "--budgets",
    "1,2",
    "--device",
    "cpu",
]


@pytest.mark.slow
def test_compare_end_to_end_writes_curves_controls_budgets_and_the_verdict(tiny_dirs, root):
    import pandas as pd

    from dihal.stages import compare_stats as stats

    args = [*COMPARE, "--model", str(tiny_dirs["llama"]), "--evaluator", str(tiny_dirs["qwen3"])]
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    art = ArtifactStore(root).resolve("latest", "compare")
    for name in (
        "compare.csv",
        "summary.csv",
        "controls.csv",
        "parts.csv",
        "samples.csv",
        "compare.json",
        "compare_x1.png",
        "compare_x2.png",
    ):
        assert art.file(name).stat().st_size > 0, name
    lines, summary, parts_df, samples = (
        pd.read_csv(art.file(n)) for n in ("compare.csv", "summary.csv", "parts.csv", "samples.csv")
    )
    result = json.loads(art.file("compare.json").read_text())
    l_star, worst = result["l_star"], result["argmin_S"]
    ld4lg = f"LD4LG-style (frozen {tiny_dirs['llama'].name} encoder)"
    curves = [
        "CoDAR",
        ld4lg,
        f"DiHAL (l*={l_star})",
        f"DiHAL (argmin S={worst})",
        f"DiHAL-direct (l*={l_star})",
        "AR hybrid (l*)",
        "original (AR)",
    ]
    prior = lines[lines.source == "trained prior"]
    # one line per row, temperature, seed and budget: curve rows at both temperatures, points once
    for row in curves:
        got = prior[prior.row == row].groupby("budget")["temperature"].apply(lambda t: sorted(t.tolist()))
        assert got.tolist() == [[0.0, 0.0, 1.0, 1.0]] * 2, (row, got)
    for row in ("Diffusion-LM", "SED"):
        assert prior[prior.row == row]["temperature"].isna().all() and len(prior[prior.row == row]) == 4
    # the controls: oracle and null for each default control row, at the grid's top temperature
    ctrl = lines[lines.source.isin(["oracle prior", "null prior"])]
    assert set(ctrl.row) == {"SED", "CoDAR", ld4lg, f"DiHAL (l*={l_star})", f"DiHAL-direct (l*={l_star})"}
    assert len(ctrl) == 5 * 2 * 2 * 2  # rows x sources x seeds x budgets
    oracle_sed = ctrl[(ctrl.row == "SED") & (ctrl.source == "oracle prior")]
    held = lines[lines.row == "held-out text"]
    np.testing.assert_allclose(oracle_sed["gen_ppl_token_evaluator"], held["gen_ppl_token_evaluator"], rtol=1e-9)
    # every line's Gen.PPL, recomputed here from the per-sample scores
    for _, line in prior.sample(6, random_state=0).iterrows():
        mask = (samples.row == line.row) & (samples.seed == line.seed) & (samples.budget == line.budget)
        mask &= samples.source == "trained prior"
        mask &= samples.temperature.isna() if pd.isna(line.temperature) else samples.temperature == line.temperature
        one = samples[mask & (samples.n_evaluator > 0)]
        expected = np.exp(one.nll_evaluator.sum() / one.n_evaluator.sum())
        assert line.gen_ppl_token_evaluator == pytest.approx(expected, rel=1e-9)
    # the headline: every interval holds its point; a point row's headline is its pooled Gen.PPL
    ok = summary.dropna(subset=["headline_evaluator"])
    assert (ok.headline_evaluator_lo <= ok.headline_evaluator).all()
    assert (ok.headline_evaluator <= ok.headline_evaluator_hi).all()
    sed = samples[(samples.row == "SED") & (samples.budget == 1) & (samples.source == "trained prior")]
    sed_head = summary[(summary.row == "SED") & (summary.budget == 1)].iloc[0]
    assert sed_head.headline_evaluator == pytest.approx(stats.gen_ppl(sed, "evaluator"), rel=1e-9)
    assert set(summary.status) <= {"ok", "not reached", "degenerate"}
    # the budgets: each part at 3 and 6 steps, the decoder's table frozen and counted
    for k, steps in ((1, 3), (2, 6)):
        trained = parts_df[(parts_df.seed == 0) & (parts_df.budget == k)]
        assert (trained["steps"] == steps).all() and len(trained) == 9
        assert (trained["tokens_seen"] == steps * trained["global_batch"] * 11).all()
    by_part = parts_df[parts_df.budget == 1].set_index("part")
    assert (by_part.loc["decoder", "frozen_parameters"] > 0).all() and (
        by_part.loc["prior", "frozen_parameters"] == 0
    ).all()
    assert by_part.filter(like="bridge", axis=0)["frozen_parameters"].gt(0).all()
    assert by_part.loc["autoencoder", "reconstruction_accuracy"].between(0, 1).all()
    enc, dec = (by_part.loc[k, "frozen_parameters"].to_numpy() for k in ("autoencoder", "decoder"))
    assert (enc > dec).all()  # the frozen encoder's blocks beside the same table
    assert [b["baseline"] for b in result["verdicts"][0]["baselines"]] == ["Diffusion-LM", "SED", "CoDAR", ld4lg]
    # claim 3 per budget, and the claims table takes it from compare.json
    assert [v["budget"] for v in result["verdicts"]] == [1, 2]
    proc = subprocess.run(
        [sys.executable, "scripts/summarize.py", "--claims", str(root / "claims.md"), str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    claim3 = next(line for line in (root / "claims.md").read_text().splitlines() if line.startswith("| 3."))
    for v in result["verdicts"]:
        assert f"{v['budget']}x: {v['claim_3']}" in claim3, claim3
    assert "cache hit" in invoke(*args).output


def test_compare_refuses_bad_requests_before_any_work(tiny_dirs, root):
    base = ["compare", "--model", str(tiny_dirs["llama"]), "--evaluator", str(tiny_dirs["qwen3"]), "--dry-run"]
    cases = {
        ("--rows", "dihal,nope"): "unknown row 'nope'",
        ("--temperatures", "0,-0.5"): "--temperatures must be >= 0",
        ("--temperatures", "0,nan"): "nan",
        ("--top-p", "1.5"): "--top-p must be in (0, 1]",
        ("--top-p", "0"): "--top-p must be in (0, 1]",
        ("--rows", "dihal,sed", "--controls", "codar"): "--controls codar: that row is not in --rows",
        ("--rows", "sed,codar"): "--rows must include dihal",
        ("--budgets", "1,0"): "--budgets must be whole multiples >= 1",
        ("--budgets", "1.5"): "cannot read --budgets",
    }
    for extra, needle in cases.items():
        res = invoke(*base, *extra)
        assert res.exit_code == 2 and "Traceback" not in res.output, (extra, res.output)
        last = res.output.strip().splitlines()[-1]
        assert last.startswith("error: ") and needle in res.output, (extra, res.output)
    res = invoke(
        "compare",
        "--model",
        str(tiny_dirs["llama"]),
        "--evaluator",
        str(tiny_dirs["llama"]),
        "--max-sequences",
        "16",
        "--seq-len",
        "12",
        "--device",
        "cpu",
    )
    assert res.exit_code == 2 and "is the backbone; the primary evaluator must be another model" in res.output
    assert ArtifactStore(root).all("prior") == []  # refused before any part was trained


def _samples(art) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in art.file("samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_every_distribution_row_honours_the_decoding_and_a_seed_repeats_it(parts, root):
    """CoDAR's decoder and DiHAL's upper blocks: sampled (t = 1) differs from argmax (t = 0), the same
    seed gives the same tokens again, and each artifact records the decoding it used. Rounding has
    none to honour: it refuses a temperature."""
    store = ArtifactStore(root)
    base = ["generate", "--mode", "parallel", "--prior", parts["prior"].id, "--num-samples", "6"]
    base += ["--prior-steps", "2", "--sample-steps", "2", "--device", "cpu"]
    for recovery, extra in {
        "decoder": ["--decoder", parts["decoder"].id],
        "hidden": ["--bridge", parts["bridge"].id],
    }.items():
        made = {}
        for name, flags in {"argmax": ["--temperature", "0"], "t1": [], "t1 again": ["--force"]}.items():
            res = invoke(*base, "--recovery", recovery, *extra, *flags)
            assert res.exit_code == 0, res.output
            made[name] = store.resolve("latest", "generate")
        assert made["argmax"].manifest["decoding"]["rule"] == "argmax"
        assert made["t1"].manifest["decoding"] == {
            "rule": "sampled, float64",
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
        }
        assert _samples(made["t1"]) == _samples(made["t1 again"]), recovery
        assert _samples(made["t1"]) != _samples(made["argmax"]), recovery
        firsts = {ids[0] for ids in _samples(made["t1"]) if ids}
        assert len(firsts) > 1, (recovery, firsts)  # the first token is drawn too, not the start state's argmax
    res = invoke(*base, "--recovery", "rounding", "--temperature", "0.7")
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1].startswith(
        "error: --recovery rounding is deterministic"
    )
    assert invoke(*base, "--recovery", "rounding").exit_code == 0
    assert store.resolve("latest", "generate").manifest["decoding"] == {"rule": "cosine rounding (deterministic)"}


@pytest.mark.slow
def test_the_controls_read_the_real_states_or_the_bare_noise(parts, root):
    """Oracle prior: rounding the held-out real h_0 gives back the held-out tokens exactly. Null prior:
    the recovery reads the prior's initial noise (zero steps), which differs from its samples."""
    from dihal.artifacts import hidden_states as hs

    store = ArtifactStore(root)
    base = ["generate", "--mode", "parallel", "--prior", parts["prior"].id, "--num-samples", "4"]
    base += ["--prior-steps", "2", "--device", "cpu", "--recovery", "rounding"]
    assert invoke(*base, "--source", "oracle").exit_code == 0
    oracle = store.resolve("latest", "generate")
    group = hs.open_group(parts["extract"])
    held = np.asarray(group["input_ids"].oindex[hs.split_indices(group, "validation")[:4]])[:, 1:]
    eos = __import__("transformers").AutoTokenizer.from_pretrained(parts["extract"].config["model"]).eos_token_id
    assert _samples(oracle) == [gen_stage_truncate(row.tolist(), eos) for row in held]
    assert "oracle prior" in oracle.manifest["metrics"]["label"]
    assert invoke(*base, "--source", "null").exit_code == 0
    null = store.resolve("latest", "generate")
    assert invoke(*base).exit_code == 0
    trained = store.resolve("latest", "generate")
    assert null.manifest["metrics"]["prior_samples_sha256"] != trained.manifest["metrics"]["prior_samples_sha256"]
    res = invoke(*base, "--source", "oracle", "--num-samples", "50")
    assert res.exit_code == 2 and "validation sequences; use --num-samples" in res.output


def gen_stage_truncate(ids, eos):
    """ids up to the first EOS (the tiny llama's only stop id: its EOS ends documents, and its
    generation_config names no other)."""
    return ids[: ids.index(eos)] if eos in ids else ids


@pytest.mark.slow
@pytest.mark.parametrize("quick", ["0", "1"])
def test_reproduce_compare_dry_run_passes_with_the_revision_2_grid(quick, tmp_path):
    import os
    from pathlib import Path

    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "DRY_RUN": "1", "QUICK": quick, "DIHAL_ROOT": str(tmp_path), "PATH": path}
    proc = subprocess.run(["bash", "scripts/reproduce_compare.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "temperatures=(0.0, 0.7, 1.0)" in out and "condition_from='prior'" in out, out
    if quick == "1":
        assert "seeds=(0,)" in out and "budgets=(1,)" in out and "budgets=(5,)" not in out, out
    else:  # both budgets on seed 0, the ablation's sigma:0.5 and prior:1.0 on CoDAR and DiHAL only
        assert "seeds=(0,), num_samples=48" in out and "seeds=(0, 1)" not in out, out
        assert "budgets=(5,)" in out and "condition_from='sigma'" in out, out
        assert "condition_noise=1.0" in out and "rows=('codar', 'dihal')" in out, out
        at_5x = "rows=('diffusion-lm', 'sed', 'codar', 'ld4lg', 'dihal'), controls=('sed', 'codar', 'ld4lg', 'dihal')"
        assert at_5x in out, out
        for gamma in ("0.0", "0.25", "1.0", "4.0"):  # the gamma ablation of METHOD 5.1, on DiHAL's readouts
            assert f"readouts=('independent', 'guided', 'causal'), guidance={gamma}" in out, out
    assert "readouts=('independent', 'guided', 'refine:2', 'causal'), guidance=1.0" in out, out
    assert "model='smollm2-135m'" in out and "evaluator='gemma3-270m'" in out, out


@pytest.mark.slow
def test_reproduce_compare_takes_gemma3_with_smollm2_as_its_evaluator(tmp_path):
    import os
    from pathlib import Path

    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "DRY_RUN": "1", "QUICK": "1", "DIHAL_ROOT": str(tmp_path), "PATH": path}
    run = lambda model: subprocess.run(
        ["bash", "scripts/reproduce_compare.sh"], cwd=REPO, env={**env, "MODEL": model}, capture_output=True, text=True
    )
    gemma = run("gemma3-270m")
    assert gemma.returncode == 0 and "model='gemma3-270m'" in gemma.stdout, gemma.stdout + gemma.stderr
    assert "evaluator='smollm2-135m'" in gemma.stdout
    bad = run("gpt2")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: MODEL=gpt2; use smollm2-135m or gemma3-270m (each is the other's evaluator)"
    )


def test_mauve_scores_each_rows_top_temperature_against_held_out_features(monkeypatch):
    """Without mauve-text the column is empty ("-" in the table); with it (a stand-in module here, since
    the GPL package is never a dependency) each budget, row and seed at the top temperature and each
    point row is scored once, its own samples' features against the held-out text's."""
    import types

    import pandas as pd

    from dihal.stages import compare_stats as stats

    rows = []
    for budget in (1, 5):
        for seed in (0, 1):
            for row, temps in (("CoDAR", (0.0, 1.0)), ("SED", (None,))):
                for t in temps:
                    for i in range(3):
                        rows.append(
                            {
                                "budget": budget,
                                "seed": seed,
                                "row": row,
                                "temperature": t,
                                "index": i,
                                "source": "prior",
                                "text": f"{row} {t} {seed} {i}",
                            }
                        )
    rows.append(
        {
            "budget": 1,
            "seed": 0,
            "row": "CoDAR",
            "temperature": 1.0,
            "index": 0,
            "source": "null",
            "text": "control",
        }
    )
    samples = pd.DataFrame(rows)
    monkeypatch.setitem(sys.modules, "mauve", None)  # not installed
    assert stats.mauve_available() is None and stats.mauve_scores(samples, None, None, 1.0, 0).empty
    seen = []

    def compute_mauve(p_features, q_features, seed, verbose):
        seen.append((p_features.copy(), q_features))
        return types.SimpleNamespace(mauve=float(p_features.sum()))

    monkeypatch.setitem(sys.modules, "mauve", types.SimpleNamespace(compute_mauve=compute_mauve))
    features = lambda ev, texts: np.array([[float(len(t))] for t in texts])
    monkeypatch.setattr(stats.eval_stage, "last_token_features", features)
    held = np.zeros((3, 1))
    out = stats.mauve_scores(samples, None, held, 1.0, 0)
    assert len(out) == 2 * 2 * 2 and set(out.row) == {"CoDAR", "SED"}  # budgets x seeds x rows, no control
    for _, r in out.iterrows():
        texts = samples[
            (samples.budget == r.budget)
            & (samples.seed == r.seed)
            & (samples.row == r.row)
            & (samples.source == "prior")
            & (samples.temperature.isna() | (samples.temperature == 1.0))
        ]
        assert r.mauve == sum(len(t) for t in texts.text)
    assert all(q is held for _, q in seen)


def test_diversity_is_per_seed_so_the_same_held_out_text_twice_keeps_its_diversity():
    """The held-out text is the same for every seed: pooled over two seeds each n-gram would count
    twice and its diversity would fall by a factor near 8 (0.728 -> 0.091 on smollm2's run)."""
    import pandas as pd

    from dihal.stages import compare_stats as stats
    from dihal.stages.text import text_metrics as tm

    texts = ["the cat sat on the mat today", "a dog ran in the park at noon", "we read the old book again"]
    rows = []
    for seed in (0, 1):
        for i, text in enumerate(texts):
            rows.append(
                {
                    "budget": 1,
                    "row": "held-out text",
                    "kind": "point",
                    "source": "data",
                    "temperature": float("nan"),
                    "seed": seed,
                    "index": i,
                    "text": text,
                    "n_tokens": 7,
                    "token_entropy": 1.9,
                    "nll_evaluator": 7.0,
                    "n_evaluator": 7,
                    "nll_backbone": 7.0,
                    "n_backbone": 7,
                }
            )
    samples = pd.DataFrame(rows)
    one_seed = tm.diversity(texts)
    assert one_seed > 0.9 and tm.diversity(texts + texts) < one_seed / 4  # what pooling did
    _, heads = stats.summarize(samples, 1.9, 0)
    assert heads.loc[0, "diversity_at_top_t"] == pytest.approx(one_seed)
    other = samples.assign(row="B", source="trained prior", text=samples.text.str.upper() + " x")
    v = stats.verdict(pd.concat([other.assign(row="A", temperature=1.0), other]), "A", "B", "evaluator", 1.9)
    assert v["points"][0]["baseline_diversity"] == pytest.approx(tm.diversity(other.text[:3].tolist()))


def test_claims_table_reads_each_budget_from_comparisons_with_every_baseline(tmp_path):
    """reproduce_compare.sh runs 5x as its own comparison of the claim-3 rows only (no diagnostic rows):
    the claims table takes its verdict beside the 1x comparison of all rows, while an ablation's
    comparison of two rows judges nothing."""
    from tests.conftest import load_script

    summarize = load_script("summarize")
    store = ArtifactStore(tmp_path)

    def comparison(rows: tuple, budget: int, claim: str) -> None:
        ours = {"budget": budget, "row": "DiHAL (l*=1)", "headline_evaluator": 100.0 * budget}
        verdict = {"budget": budget, "claim_3": claim, "baselines": [{"baseline": "SED", "outcome": claim}]}
        result = {"verdicts": [verdict], "summary": [ours], "ours": "DiHAL (l*=1)", "seeds": [0]}
        result["held_out_entropy"] = 3.0
        write = lambda art: art.file("compare.json").write_text(json.dumps(result))
        store.run_stage(Job("compare", 1, {"rows": list(rows), "budgets": [budget]}, {}, write))

    assert summarize.claim_compare(store) == ("not run", "-")
    comparison((), 1, "holds partly")
    comparison(("diffusion-lm", "sed", "codar", "ld4lg", "dihal"), 5, "does not hold")
    comparison(("codar", "dihal"), 1, "ablation")  # newer, but it leaves baselines out
    ours, verdict = summarize.claim_compare(store)
    assert verdict == "1x: holds partly; 5x: does not hold", verdict
    assert "1x (seeds 0): DiHAL Gen.PPL 100" in ours and "5x (seeds 0): DiHAL Gen.PPL 500" in ours, ours


def test_claims_table_names_lm_written_rows_and_each_cost_class(tmp_path):
    """METHOD 5.1 in docs/claims.md: the claim's cell is one verdict and one line of numbers per budget; the
    detail below the table names the rows whose prior gain is below 1.5 with their gains and each DiHAL
    readout's verdict against its own cost class."""
    from tests.conftest import load_script

    summarize = load_script("summarize")
    store = ArtifactStore(tmp_path)
    summary = [
        {"budget": 1, "row": "DiHAL (l*=1)", "headline_evaluator": 900.0, "lm_written": False, "prior_gain": 5.6},
        {"budget": 1, "row": "CoDAR", "headline_evaluator": 400.0, "lm_written": True, "prior_gain": 0.55},
        {"budget": 1, "row": "SED", "headline_evaluator": 3e3, "lm_written": False, "prior_gain": 21.0},
        {"budget": 1, "row": "Diffusion-LM", "headline_evaluator": 80.0, "lm_written": None, "prior_gain": None},
    ]
    classes = [
        {"budget": 1, "class": "one-pass", "dihal": "DiHAL (l*=1)", "claim_3": "holds"},
        {"budget": 1, "class": "token-by-token", "dihal": "DiHAL (l*=1), causal", "claim_3": "not decided"},
    ]
    result = {"summary": summary, "ours": "DiHAL (l*=1)", "seeds": [0], "held_out_entropy": 3.0}
    result["verdicts"] = [{"budget": 1, "claim_3": "partly", "baselines": []}]
    result["verdicts_by_class"] = classes
    write = lambda art: art.file("compare.json").write_text(json.dumps(result))
    store.run_stage(Job("compare", 1, {"rows": [], "budgets": [1]}, {}, write))
    ours, verdict = summarize.claim_compare(store)
    assert ours == "1x (seeds 0): DiHAL Gen.PPL 900 at H 3.00" and verdict == "1x: partly"  # the cell: at a glance
    (detail,) = summarize.claim_compare_details(store)
    assert detail == (
        "- 1x: partly. no baseline judged; LM-written (prior gain < 1.5, decides nothing): CoDAR (gain 0.55); "
        "by cost class: one-pass independent: holds, token-by-token causal: not decided"
    )


# -- the readouts of METHOD 5.1 (issue 36) -------------------------------------------------------------------
def _parallel(parts, *extra) -> dict:
    """One parallel generation through the CLI; its manifest metrics and its samples' token ids."""
    base = ["generate", "--mode", "parallel", "--prior", parts["prior"].id, "--num-samples", "4", "--device", "cpu"]
    ok(invoke(*base, *extra))
    art = ArtifactStore(parts["prior"].root).resolve("latest", "generate")
    rows = [json.loads(line) for line in art.file("samples.jsonl").read_text().splitlines()]
    return {"metrics": art.manifest["metrics"], "tokens": [r["token_ids"] for r in rows], "config": art.config}


@pytest.mark.slow
def test_readouts_meet_their_limits(parts):
    """guided at gamma 0 is independent (the same draws), at a huge gamma rounding; refine:0 is guided; the
    plan agreement of rounding is 1; s^2 is the one computed by hand from the prior's samples."""
    hidden = ["--recovery", "hidden", "--bridge", parts["bridge"].id]
    independent = _parallel(parts, *hidden)
    assert "readout" not in independent["config"]  # independent keeps the ids made before the readouts
    assert _parallel(parts, *hidden, "--readout", "guided", "--guidance", "0")["tokens"] == independent["tokens"]
    rounding_ = _parallel(parts, "--recovery", "rounding")
    assert rounding_["metrics"]["plan_agreement"] == 1.0
    huge = _parallel(parts, *hidden, "--readout", "guided", "--guidance", "1e9")
    assert huge["tokens"] == rounding_["tokens"] and huge["metrics"]["plan_agreement"] == 1.0
    guided = _parallel(parts, *hidden, "--readout", "guided")
    assert _parallel(parts, *hidden, "--readout", "refine:0")["tokens"] == guided["tokens"]
    assert guided["metrics"]["readout"] == "guided" and guided["metrics"]["guidance"] == 1.0
    refined = _parallel(parts, *hidden, "--readout", "refine:2")
    assert refined["metrics"]["passes"] == 3 and refined["metrics"]["label"].endswith(", refine:2 gamma 1")
    # s^2 by hand: the mean per-dimension squared distance between unit vectors and their cosine-nearest token's
    from dihal.stages.lm.models import load_model
    from dihal.stages.lm.vocab import embedding_table
    from dihal.stages.parts.prior import Prior

    prior = Prior.load(parts["prior"], "cpu")
    e = prior.sample(4, GenerateConfig.prior_steps, 0, GenerateConfig.batch_size, None)
    raw = (e * prior.sigma + prior.mu).reshape(-1, e.shape[-1]).double().numpy()
    table = embedding_table(load_model(parts["extract"].config["model"], "cpu", "float32").model).double().numpy()
    unit = lambda x: x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)  # F.normalize's eps
    u, t = unit(raw), unit(table)
    nn = (u @ t.T).argmax(1)
    s2 = float(((u - t[nn]) ** 2).sum(1).mean() / u.shape[1])
    assert guided["metrics"]["s2"] == pytest.approx(s2, rel=1e-4)
    assert 0 <= guided["metrics"]["plan_agreement"] <= 1


@pytest.mark.slow
def test_causal_with_the_oracle_prior_and_a_huge_gamma_writes_the_held_out_text(parts):
    from dihal.artifacts import hidden_states as hs

    hidden = ["--recovery", "hidden", "--bridge", parts["bridge"].id, "--source", "oracle"]
    causal = _parallel(parts, *hidden, "--readout", "causal", "--guidance", "1e9")
    group = hs.open_group(parts["extract"])
    ids = np.asarray(group["input_ids"].oindex[hs.split_indices(group, "validation")[:4]])[:, 1:]
    eos = __import__("transformers").AutoTokenizer.from_pretrained(parts["extract"].config["model"]).eos_token_id
    assert causal["tokens"] == [gen_stage_truncate(row.tolist(), eos) for row in ids]
    assert causal["metrics"]["readout"] == "causal" and causal["metrics"]["plan_agreement"] == 1.0
    # at gamma 0 it is the hybrid reading its own tokens: not the held-out text
    assert _parallel(parts, *hidden, "--readout", "causal", "--guidance", "0")["tokens"] != causal["tokens"]


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--recovery", "hidden", "--readout", "sideways"], "unknown --readout 'sideways'; use one of independent"),
        (["--recovery", "hidden", "--readout", "refine:-1"], "--readout refine:K takes a whole number K >= 0"),
        (["--recovery", "hidden", "--readout", "guided", "--guidance", "nan"], "--guidance must be a finite number"),
        (["--recovery", "hidden", "--readout", "guided", "--guidance", "-1"], "--guidance must be >= 0"),
        (["--recovery", "rounding", "--readout", "guided"], "--recovery rounding has no logits to read"),
    ],
)
def test_bad_readouts_are_one_line(extra, says, parts):
    base = ["generate", "--mode", "parallel", "--prior", parts["prior"].id, "--device", "cpu"]
    res = invoke(*base, *extra)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    line = res.output.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("error: ") and says in line[0], res.output


@pytest.mark.slow
def test_compare_reads_dihal_every_way_and_says_whose_text_each_row_writes(tiny_dirs, root):
    """--readout adds DiHAL (l*) rows with DiHAL's controls; the summary's prior gain and plan agreement are
    the ones recomputed here from the samples; the verdict compares like with like (METHOD 5.1)."""
    import pandas as pd

    args = [*COMPARE, "--model", str(tiny_dirs["llama"]), "--evaluator", str(tiny_dirs["qwen3"])]
    args[args.index("--seeds") + 1], args[args.index("--budgets") + 1] = "0", "1"
    extra = ["--rows", "diffusion-lm,sed,codar,dihal", "--controls", "sed,codar,dihal"]
    ok(invoke(*args, *extra, "--readout", "independent,guided,refine:1,causal", "--guidance", "2"))
    art = ArtifactStore(root).resolve("latest", "compare")
    assert art.config["readouts"] == ["independent", "guided", "refine:1", "causal"] and art.config["guidance"] == 2
    result = json.loads(art.file("compare.json").read_text())
    summary, samples = (pd.read_csv(art.file(n)) for n in ("summary.csv", "samples.csv"))
    dihal = f"DiHAL (l*={result['l_star']})"
    readouts = {
        f"{dihal}, {r}": c for r, c in (("guided", "one-pass"), ("refine:1", "refine"), ("causal", "token-by-token"))
    }
    cost = summary.set_index("row")["cost"]
    assert {r: cost[r] for r in readouts} == readouts
    assert cost[dihal] == cost["SED"] == "one-pass" and cost["CoDAR"] == "token-by-token"
    controlled = samples[samples.source == "null prior"].row.unique()
    assert set(readouts) <= set(controlled)  # DiHAL's controls for every readout
    for _, head in summary[summary.row.isin(["CoDAR", "SED", *readouts])].iterrows():
        mine = samples[samples.row == head.row]
        null = mine[mine.source == "null prior"]
        t = null.temperature.iloc[0]
        trained = mine[(mine.source == "trained prior")]
        trained = trained[trained.temperature.isna()] if pd.isna(t) else trained[trained.temperature == t]
        ppl = lambda g: float(np.exp(g.nll_evaluator[g.n_evaluator > 0].sum() / g.n_evaluator[g.n_evaluator > 0].sum()))
        gain = ppl(null) / ppl(trained)  # Gen.PPL from the samples' token NLLs, not stats.gen_ppl
        assert head.prior_gain == pytest.approx(gain, rel=1e-9)
        assert bool(head.lm_written) == (gain < 1.5)
    plan = summary.set_index("row")["plan_agreement"]
    assert plan["SED"] == 1.0 and 0 <= plan[f"{dihal}, causal"] <= 1
    classes = {(v["class"], v["dihal"]): [b["baseline"] for b in v["baselines"]] for v in result["verdicts_by_class"]}
    assert classes == {
        ("one-pass", dihal): ["Diffusion-LM", "SED"],
        ("one-pass", f"{dihal}, guided"): ["Diffusion-LM", "SED"],
        ("refine (beside both)", f"{dihal}, refine:1"): ["Diffusion-LM", "SED", "CoDAR"],
        ("token-by-token", f"{dihal}, causal"): ["CoDAR"],
    }
    lm_written = set(summary[summary.lm_written == True].row)  # noqa: E712 (a column of True, False and NaN)
    assert set(result["lm_written"]) == lm_written
    for v in result["verdicts_by_class"]:
        for b in v["baselines"]:
            if b["baseline"] in lm_written and v["dihal"] not in lm_written:
                assert b["outcome"] == "baseline LM-written" and "measured" in b


def _tables(root) -> dict:
    """compare's tables as written, without their clocks (wall seconds and ms per sample differ run to run)."""
    import pandas as pd

    art = ArtifactStore(root).resolve("latest", "compare")
    assert art.complete
    out = {}
    for name in ("compare.csv", "summary.csv", "controls.csv", "parts.csv", "samples.csv"):
        frame = pd.read_csv(art.file(name), keep_default_na=False, dtype=str)  # the written text, as it is
        out[name] = frame.drop(columns=[c for c in frame.columns if "seconds" in c or c.startswith("ms_per")])
    return out


@pytest.mark.slow
def test_compare_on_two_ranks_writes_one_process_table_bit_for_bit_and_resumes_under_either(tiny_dirs, tmp_path):
    """Issue 65: compare deals its units (each part's training, each generation with its scoring) over the
    ranks; each unit seeds its randomness from itself, so two gloo ranks write the one-process table to the
    last digit (every process one thread, as torchrun's ranks). The log names each unit once, with its rank.
    Killed under two ranks, the same command on one process redoes only the units not complete."""
    from tests.conftest import run_cli, torchrun

    base = tmp_path / "base"
    data = ["--model", str(tiny_dirs["llama"]), "--max-sequences", "48", "--seq-len", "12", "--device", "cpu"]
    run_cli("extract", *data, "--layers", "all", "--root", str(base), check=True)
    run_cli("score", "--extract", "latest", "--tokens", "150", "--root", str(base), check=True)
    for name in ("one", "two", "killed"):
        shutil.copytree(base, tmp_path / name)
    args = ["compare", "--extract", "latest", "--score", "latest", "--evaluator", str(tiny_dirs["qwen3"])]
    args += ["--seeds", "0,1", "--num-samples", "4", "--prior-steps", "3", "--sample-steps", "2", "--budgets", "1"]
    args += ["--train-steps", "3", "--width", "16", "--depth", "1", "--temperatures", "0,1", "--controls", "dihal"]
    args += ["--device", "cpu"]
    one = run_cli(*args, "--root", str(tmp_path / "one"), env={"OMP_NUM_THREADS": "1"}, check=True)
    two = torchrun(*args, "--root", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _tables(tmp_path / "one"), _tables(tmp_path / "two")
    for name in a:
        assert a[name].equals(b[name]), name
    # every unit named once in each log, with its rank under torchrun; both ranks did some
    units = [line.split("] ")[-1] for line in one.stderr.splitlines() if line.strip().startswith("budget x1, seed")]
    assert len(units) == len(set(units)) > 20, units
    named = [line for line in two.stderr.splitlines() if "budget x1, seed" in line and "(rank " in line]
    assert sorted(n.split("budget x1")[1].rsplit(" (rank", 1)[0] for n in named) == sorted(
        u.split("budget x1")[1] for u in units
    )
    assert {n.rsplit("(rank ", 1)[1] for n in named} == {"0)", "1)"}
    # killed on rank 0 in the middle of its parts; torchrun takes rank 1 down with it
    killed = torchrun(*args, "--root", str(tmp_path / "killed"), kill_after=7)
    assert killed.returncode != 0
    store = ArtifactStore(tmp_path / "killed")
    before = {a.id: (a.path / "manifest.json").read_bytes() for a in store.all() if a.complete}
    unfinished = [a.id for a in store.all() if not a.complete]
    assert unfinished and any(a.stage == "prior" for a in store.all() if a.complete)
    again = run_cli(*args, "--root", str(tmp_path / "killed"), env={"OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    after = {a.id: a for a in ArtifactStore(tmp_path / "killed").all()}
    assert all((after[i].path / "manifest.json").read_bytes() == m for i, m in before.items())  # not redone
    assert all(after[i].complete for i in unfinished)
    c = _tables(tmp_path / "killed")
    for name in a:
        assert a[name].equals(c[name]), name


@pytest.mark.slow
def test_compare_with_computed_states_reads_token_ids_and_trains_the_store_paths_parts(tiny_dirs, root, monkeypatch):
    """Issue 64 items 1 and 2: `compare --states model` runs on an extract of the token ids alone (--layers none)
    with the score of another extract of the same backbone; every part over a layer (the bridges, DiHAL-direct's
    prior over h_l, the priors over h_0, the decoder, the autoencoder) computes its states from the backbone and
    equals the store path's on a float32 extract of all layers to float rounding, as does DiHAL-direct's oracle
    control (held-out h_l computed, not read). Nothing reads a stored layer. Without --states model that score
    is refused in one line."""
    import pandas as pd

    from dihal.stages.diffusion import feed

    common = ["--model", str(tiny_dirs["llama"]), "--seq-len", "12", "--max-sequences", "48", "--device", "cpu"]
    store = ArtifactStore(root)
    ok(invoke("extract", *common, "--layers", "all", "--store-dtype", "float32"))
    full = store.resolve("latest", "extract")
    ok(invoke("extract", *common, "--layers", "none"))
    only0 = store.resolve("latest", "extract")
    ok(invoke("score", "--extract", full.id, "--tokens", "150"))
    score = store.resolve("latest", "score")
    args = [*COMPARE, "--evaluator", str(tiny_dirs["qwen3"]), "--score", score.id]
    args[args.index("--seeds") + 1], args[args.index("--budgets") + 1] = "0", "1"
    args[args.index("--temperatures") + 1] = "1"
    args += ["--rows", "dihal,dihal-direct", "--controls", "dihal-direct"]
    res = invoke(*args, "--extract", only0.id)
    assert res.exit_code == 2 and "was made from extract" in res.output and len(res.output.strip().splitlines()) == 1
    ok(invoke(*args, "--extract", full.id))
    stored = store.resolve("latest", "compare")
    layers, real = [], feed.stored
    monkeypatch.setattr(
        feed, "stored", lambda group, layer, *a, **k: layers.append(layer) or real(group, layer, *a, **k)
    )
    ok(invoke(*args, "--extract", only0.id, "--states", "model"))
    computed = store.resolve("latest", "compare")
    assert computed.id != stored.id and computed.config["states"] == "model" and "states" not in stored.config
    assert layers == []  # no part reads a stored layer
    a, b = (pd.read_csv(art.file("parts.csv")) for art in (stored, computed))
    assert a["part"].tolist() == b["part"].tolist()
    np.testing.assert_allclose(b["val_loss"], a["val_loss"], rtol=1e-5)
    kinds = set()
    for part in b["id"]:
        part_cfg = store.resolve(part).config
        if not part_cfg.get("latent") and part_cfg.get("data", "extract") == "extract":  # over a layer
            assert part_cfg["states"] == "model", part
            kinds.add((store.resolve(part).stage, part_cfg.get("layer")))
    assert {("bridge", 1), ("prior", 0)} <= kinds and len(kinds) >= 3  # h_l's and h_0's parts, computed
    lines = lambda art: pd.read_csv(art.file("compare.csv")).set_index(["row", "source"])
    oracle = [i for i in lines(computed).index if i[1] == "oracle prior"]
    assert oracle and all("DiHAL-direct" in row for row, _ in oracle)
    np.testing.assert_allclose(
        lines(computed).loc[oracle, "gen_ppl_token_evaluator"],
        lines(stored).loc[oracle, "gen_ppl_token_evaluator"],
        rtol=1e-4,
    )

"""The prior's remedies (issue 52): a time distribution shifted toward noise, a cross-entropy on the x0
estimate's token, and a prior that reads a corpus' tokens instead of an extract's stored states."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.files import load_tensors
from dihal.artifacts.store import ArtifactStore
from dihal.stages.configs import PriorConfig
from dihal.stages.diffusion import flow
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
from dihal.stages.diffusion.draws import ItemDraws
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.runtime.progress import NullProgress
from dihal.stages.train_prior import TOKEN_CE_TEMPERATURE, PriorTask, Tokens, token_data
from tests.conftest import invoke
from tests.test_house import one_error_line

SMALL = ["--width", "16", "--depth", "1", "--heads", "2", "--batch-size", "4", "--train-steps", "3"]


# -- the shifted time distribution -----------------------------------------------------------------------
@pytest.mark.parametrize("shift", [1.0, 3.0, 0.5])
def test_shifted_times_have_the_stated_quantiles(shift):
    """P(t <= q) = q / (s - (s - 1) q): checked on 400k uniform draws to 0.004 (the empirical CDF's standard
    error is below 0.001); s > 1 puts the median s / (1 + s) above 1/2, toward noise (t = 1)."""
    t = flow.shift_time(torch.rand(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64), shift)
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        assert abs((t <= q).double().mean().item() - q / (shift - (shift - 1) * q)) < 0.004, q
    assert abs(t.median().item() - shift / (1 + shift)) < 0.004
    assert t.min() >= 0 and t.max() <= 1


# -- the token cross-entropy ----------------------------------------------------------------------------------
def _task(tmp_path, token_ce: float, table: torch.Tensor, ids: np.ndarray, mu, sigma, **recipe):
    """A PriorTask built as the stage builds it, on an extract whose layer 0 is table[ids]."""
    n, length = ids.shape
    name = f"h{token_ce}-{'-'.join(f'{k}{v}' for k, v in recipe.items())}.zarr"
    group = hs.create(tmp_path / name, [0], n, length, table.shape[1], {0: "float32"}, 4, {})
    group["layers/0"][:] = table[torch.from_numpy(ids)].numpy()
    group["input_ids"][:] = ids
    group["split"][:] = np.array([0] * (n - 2) + [1] * 2, dtype=np.int8)
    cfg = PriorConfig.for_run(
        "compare-cpu", {}, layer=0, token_ce=token_ce, seed=0, device="cpu", dtype="float32", **recipe
    )
    norm = Normalizer(mu, sigma, mu, sigma, torch.zeros_like(mu))
    tokens = Tokens(table, ids, hs.split_indices(group, "train")) if token_ce else None
    return PriorTask(group, cfg, norm, tokens)


def _losses_and_grads(tasks, batch, positions: np.ndarray):
    """One small prior network, and each task's loss on the batch (the same draws) and its x0 head's gradient."""
    torch.manual_seed(0)
    net = Denoiser(DenoiserConfig(dim=4, width=16, depth=1, heads=2, max_len=4, causal=False, condition=False))
    losses, grads = [], []
    for task in tasks:
        net.zero_grad()
        loss = task.loss(net, batch, ItemDraws(len(positions), 0, positions), torch.device("cpu"))
        loss.backward()
        losses.append(loss)
        grads.append(net.out.weight.grad.clone())
    return net, losses, grads


def test_token_ce_is_the_cross_entropy_of_the_cosine_nearest_token_and_its_gradient_reaches_the_x0_head(tmp_path):
    """The loss with --token-ce w is the x0 MSE plus w times, per sequence, the mean over positions of
    -log softmax(cos(x0_hat * sigma + mu, E_v) / 0.1)[true token] over the training sequences' types, computed
    here position by position; its gradient on the output layer is the MSE's plus w times that term's."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(9, 4, generator=gen)
    ids = torch.randint(0, 7, (10, 5), generator=gen).numpy()  # types 7 and 8 never appear: not in the softmax
    mu, sigma = torch.randn(4, generator=gen), torch.rand(4, generator=gen) + 0.5
    plain, with_ce = _task(tmp_path, 0.0, table, ids, mu, sigma), _task(tmp_path, 0.7, table, ids, mu, sigma)
    positions = np.array([0, 3, 5])
    batch = with_ce.read(positions)
    net, losses, grads = _losses_and_grads((plain, with_ce), batch, positions)
    # the same draws: the network's output again, and the CE written out position by position
    y = with_ce.normalize(batch["y"])
    draws = ItemDraws(3, 0, positions)
    t = draws.rand()
    x_t = flow.noisy(y, draws.randn(*y.shape[1:]), t)
    net.zero_grad()
    out = net(x_t, t)
    types = sorted(set(ids[:8, 1:].ravel().tolist()))
    ce = []
    for b in range(out.shape[0]):
        per = []
        for p in range(out.shape[1]):
            raw = out[b, p] * sigma + mu
            cos = torch.stack([torch.cosine_similarity(raw, table[v], dim=0) for v in types]) / TOKEN_CE_TEMPERATURE
            per.append(torch.logsumexp(cos, 0) - cos[types.index(int(batch["ids"][b, p]))])
        ce.append(torch.stack(per).mean())
    term = 0.7 * torch.stack(ce).sum()
    torch.testing.assert_close(losses[1] - losses[0], term, rtol=1e-5, atol=1e-6)
    term.backward()
    assert net.out.weight.grad.abs().max() > 1e-4  # the term reaches the x0 head
    torch.testing.assert_close(grads[1] - grads[0], net.out.weight.grad, rtol=1e-4, atol=1e-6)


def test_token_ce_max_t_keeps_the_cross_entropy_of_the_sequences_noised_to_t_at_most_it_and_no_other(tmp_path):
    """--token-ce-max-t m: the loss is the x0 MSE plus w times the cross-entropy of exactly the sequences whose
    drawn t is <= m (m is put between the draws, so one sequence keeps its term and two lose theirs), and the
    gradient on the x0 head is the MSE's plus that of the kept term alone."""
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(9, 4, generator=gen)
    ids = torch.randint(0, 7, (10, 5), generator=gen).numpy()
    mu, sigma = torch.randn(4, generator=gen), torch.rand(4, generator=gen) + 0.5
    positions = np.array([0, 3, 5])
    t = ItemDraws(3, 0, positions).rand()
    low = sorted(t.tolist())
    m = (low[0] + low[1]) / 2
    plain = _task(tmp_path, 0.0, table, ids, mu, sigma)
    full = _task(tmp_path, 0.7, table, ids, mu, sigma)
    limited = _task(tmp_path, 0.7, table, ids, mu, sigma, token_ce_max_t=m)
    batch = full.read(positions)
    net, losses, grads = _losses_and_grads((plain, limited), batch, positions)
    y = full.normalize(batch["y"])  # the same draws again: the network's output and each sequence's CE
    draws = ItemDraws(3, 0, positions)
    t_again = draws.rand()
    out = net(flow.noisy(y, draws.randn(*y.shape[1:]), t_again), t_again)
    net.zero_grad()
    ce = full.token_ce(out, torch.from_numpy(batch["ids"]))
    kept = t_again <= m
    assert kept.sum() == 1
    term = 0.7 * ce[kept].sum()
    torch.testing.assert_close(losses[1] - losses[0], term, rtol=1e-5, atol=1e-6)
    term.backward()
    torch.testing.assert_close(grads[1] - grads[0], net.out.weight.grad, rtol=1e-4, atol=1e-6)
    assert "token_ce_max_t" not in full.cfg.hashed() and limited.cfg.hashed()["token_ce_max_t"] == m


# -- a corpus read as tokens ----------------------------------------------------------------------------------
def _extract(tiny_dirs, kind: str) -> list[str]:
    return ["extract", "--model", str(tiny_dirs[kind]), "--max-sequences", "16", "--seq-len", "12"] + [
        "--val-fraction",
        "0.25",
        "--layers",
        "0",
        "--device",
        "cpu",
    ]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])  # gemma3 scales its embeddings by sqrt(d)
def test_the_corpus_reader_embeds_tokens_as_the_extract_stores_h0(kind, tiny_dirs, root):
    """Every sequence's h_0 from its token ids and the backbone's table equals the extract's stored h_0 to
    float16 precision (the extract's storage), positions 0..T-1, train and validation alike."""
    assert invoke(*_extract(tiny_dirs, kind)).exit_code == 0
    store = ArtifactStore(root)
    extract = store.resolve("latest", "extract")
    group = hs.open_group(extract)
    cfg = PriorConfig.for_run("compare-cpu", {}, layer=0, data="corpus", seed=0, device="cpu", dtype="float32")
    tokens, about = token_data(cfg, extract, group, NullProgress())
    assert about == {}
    seqs = np.arange(group["input_ids"].shape[0])
    stored = hs.read_sequences(group, 0, seqs)
    embedded = tokens.embed(seqs)
    scale = np.abs(stored).max()
    assert scale > 1.0 if kind == "gemma3" else True  # the scaled table, not the raw one
    np.testing.assert_allclose(embedded, stored, rtol=2**-10, atol=2**-10 * scale)


def test_a_prior_on_the_extracts_tokens_trains_as_one_on_its_stored_states(tiny_dirs, root):
    """--data corpus reads the same sequences in the same order as the stored states (to float16): the two
    priors' validation losses agree to 1e-3, and a different seed does not (so the check can fail)."""
    assert invoke(*_extract(tiny_dirs, "llama")).exit_code == 0
    store = ArtifactStore(root)
    losses = {}
    for data, seed in (("extract", "0"), ("corpus", "0"), ("corpus", "1")):
        res = invoke("train-prior", *SMALL, "--data", data, "--seed", seed, "--device", "cpu")
        assert res.exit_code == 0, res.output
        art = store.resolve("latest", "prior")
        assert art.config["data"] == data if data != "extract" else "data" not in art.config  # the old ids keep
        losses[data, seed] = art.manifest["metrics"]["val_loss"]
    assert abs(losses["extract", "0"] - losses["corpus", "0"]) < 1e-3 * losses["extract", "0"]
    assert abs(losses["corpus", "1"] - losses["corpus", "0"]) > 1e-3 * losses["extract", "0"]


def test_a_prior_on_another_corpus_records_what_it_saw_and_the_files_content_names_it(tiny_dirs, root, tmp_path):
    assert invoke(*_extract(tiny_dirs, "llama")).exit_code == 0
    text = tmp_path / "more.txt"
    text.write_text("\n\n".join(f"document {i}: the quick brown fox jumps over lazy dogs " * 6 for i in range(20)))
    store = ArtifactStore(root)
    res = invoke("train-prior", *SMALL, "--data", f"corpus:{text}", "--device", "cpu")
    assert res.exit_code == 0, res.output
    first = store.resolve("latest", "prior")
    m = first.manifest["metrics"]
    assert m["n_train_sequences"] > 12  # not the extract's 12 training sequences
    assert m["distinct_sequences_seen"] == min(3 * 4, m["n_train_sequences"])
    assert m["steps_per_epoch"] == -(-m["n_train_sequences"] // 4) and m["epochs_seen"] == 3 / m["steps_per_epoch"]
    assert len(m["corpus_fingerprint"]) >= 12 and m["corpus_documents"] == 20
    res = invoke("train-prior", *SMALL, "--data", f"corpus:{tmp_path}/./more.txt", "--device", "cpu")
    assert "cache hit" in res.output and store.resolve("latest", "prior").id == first.id, res.output  # one corpus
    text.write_text(text.read_text().replace("lazy", "sleepy"))  # the same path, other bytes: another id
    res = invoke("train-prior", *SMALL, "--data", f"corpus:{text}", "--device", "cpu")
    assert res.exit_code == 0 and "cache hit" not in res.output, res.output
    assert store.resolve("latest", "prior").id != first.id


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--data", "corpora"], "--data must be extract, corpus or corpus:SPEC"),
        (["--data", "corpus:"], "--data must be extract, corpus or corpus:SPEC"),
        (["--data", "corpus", "--layer", "2"], "model layer 0"),
        (["--token-ce", "nan"], "--token-ce must be a finite number"),
        (["--time-shift", "0"], "--time-shift must be a finite number > 0"),
        (["--token-ce", "0.1", "--token-ce-max-t", "0"], "--token-ce-max-t must be a time in (0, 1]"),
        (["--token-ce", "0.1", "--token-ce-max-t", "inf"], "--token-ce-max-t must be a finite number"),
        (["--token-ce-max-t", "0.5"], "give --token-ce w > 0 with it"),
    ],
)
def test_bad_remedy_flags_are_one_line(flags, words, root):
    res = invoke("train-prior", *flags, "--dry-run")
    assert one_error_line(res) and words in res.output, res.output


def test_a_missing_corpus_file_is_one_line_before_any_training(tiny_dirs, root, tmp_path):
    assert invoke(*_extract(tiny_dirs, "llama")).exit_code == 0
    res = invoke("train-prior", *SMALL, "--data", f"corpus:{tmp_path / 'gone.txt'}", "--device", "cpu")
    assert one_error_line(res) and "does not exist" in res.output, res.output
    assert not list((root / "prior").glob("*/manifest.json")) if (root / "prior").exists() else True


def test_the_manifest_of_a_default_prior_says_how_much_of_its_data_it_saw(tiny_dirs, root):
    assert invoke(*_extract(tiny_dirs, "llama")).exit_code == 0
    assert invoke("train-prior", *SMALL, "--device", "cpu").exit_code == 0
    art = ArtifactStore(root).resolve("latest", "prior")
    m = art.manifest["metrics"]
    assert m["distinct_sequences_seen"] == min(12, m["n_train_sequences"]) and m["n_train_sequences"] == 12
    assert "time_shift" not in art.config and "token_ce" not in art.config  # defaults keep the published ids
    assert json.loads(art.file("prior.json").read_text())["layer"] == 0


def test_compare_gives_its_prior_recipe_to_every_prior_over_h0_and_to_no_other_part():
    from dihal.stages.compare import part_configs
    from dihal.stages.configs import CompareConfig

    cfg = CompareConfig(
        seeds=(0,), prior_time_shift=3.0, prior_token_ce=0.1, prior_data="corpus", prior_token_ce_max_t=0.5
    )
    seen = set()
    for spec, _, part in part_configs(cfg, 0, l_star=2, worst=1).values():
        if spec.stage == "prior":
            over_h0 = part.layer == 0 and not part.latent
            want = (3.0, 0.1, "corpus", 0.5) if over_h0 else (1.0, 0.0, "extract", 1.0)
            assert (part.time_shift, part.token_ce, part.data, part.token_ce_max_t) == want, spec
            seen.add(over_h0)
    assert seen == {True, False}  # the shared and SED's priors, and DiHAL-direct's and LD4LG-style's
    recipe = {"prior_time_shift", "prior_token_ce", "prior_data", "prior_token_ce_max_t"}
    assert not recipe & set(CompareConfig(seeds=(0,)).hashed())


def test_a_comparison_on_another_corpus_is_named_by_its_content(tmp_path):
    """compare --prior-data corpus:FILE hashed the path alone, so an edited file served the old comparison
    (its priors, retrained under their content-named ids, were never asked for)."""
    from types import SimpleNamespace

    from dihal.stages.compare import compare_key
    from dihal.stages.configs import CompareConfig

    text = tmp_path / "more.txt"
    text.write_text("the quick brown fox " * 50)
    plan = SimpleNamespace(l_star=2, worst=1, primary="gemma3-270m")
    key = lambda spelled: compare_key(CompareConfig(seeds=(0,), prior_data=f"corpus:{spelled}"), plan)
    first = key(text)
    assert first["prior_data"].startswith("corpus:more.txt@") and "prior_data_sha256" in first
    assert key(f"{tmp_path}/./more.txt") == first  # another spelling: the same comparison
    text.write_text("a slow green turtle " * 50)
    assert key(text)["prior_data_sha256"] != first["prior_data_sha256"]
    assert "prior_data" not in compare_key(CompareConfig(seeds=(0,)), plan)  # the default keeps its id


def test_time_shift_trains_the_prior_on_the_shifted_times_of_the_same_draws(tiny_dirs, root, monkeypatch):
    """--time-shift 3 changes what train-prior computes, not only flow.shift_time: every training step noises
    its sequences to t = 3u / (1 + 2u) of the very u that --time-shift 1 uses at that step, validation keeps its
    fixed times, and the weights differ (before, no test held the stage to it)."""
    assert invoke(*_extract(tiny_dirs, "llama")).exit_code == 0
    seen: dict[tuple, list[torch.Tensor]] = {}
    real = flow.noisy

    def spy(y, eps, t):  # training steps (with grad) and validation (without), apart
        key = (current, "train" if torch.is_grad_enabled() else "validation")
        seen.setdefault(key, []).append(torch.as_tensor(t).detach().clone().reshape(-1))
        return real(y, eps, t)

    monkeypatch.setattr(flow, "noisy", spy)
    weights = {}
    for current in ("1", "3"):
        res = invoke("train-prior", *SMALL, "--time-shift", current, "--device", "cpu")
        assert res.exit_code == 0, res.output
        art = ArtifactStore(root).resolve("latest", "prior")
        assert art.config.get("time_shift", 1.0) == float(current)  # the default stays out of old ids
        weights[current] = torch.cat([v.flatten() for v in load_tensors(art.file("weights_ema.safetensors")).values()])
    u, shifted = torch.cat(seen["1", "train"]), torch.cat(seen["3", "train"])
    assert u.numel() == shifted.numel() == 3 * 4 and 0 < float(u.min()) and float(u.max()) < 1  # steps x batch
    torch.testing.assert_close(shifted, 3 * u / (1 + 2 * u), rtol=1e-6, atol=1e-7)
    assert float(shifted.mean()) > float(u.mean()) + 0.1  # toward noise
    assert not torch.equal(weights["1"], weights["3"])
    # validation measures both on the same fixed times, so their losses compare
    assert torch.equal(torch.cat(seen["1", "validation"]), torch.cat(seen["3", "validation"]))

"""The trainer's data path and step as a GPU wants them (issue 64 items 3 and 4): contiguous reads of the
store as stored, the float32 conversion where the step runs, the same bytes as the host path made; and a
training step that reads nothing back from the device (losses reach the host every few steps)."""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dihal.artifacts import files
from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from dihal.stages.diffusion import feed, trainer
from tests.conftest import invoke
from tests.test_bridge import TINY, make_tiny_extract


@pytest.fixture
def tiny_bridge_extract(tiny_dirs, root):
    return make_tiny_extract(tiny_dirs, root)


@pytest.fixture
def float16_layers(tmp_path):
    """30 sequences, chunks of 4, a float16 layer with a scale and its exact position 0, a float32 layer."""
    n, t, d = 30, 5, 3
    group = hs.create(tmp_path / "h.zarr", [0, 2], n, t, d, {0: "float16", 2: "float32"}, 4, {}, {0: 4.0})
    rng = np.random.default_rng(0)
    group["layers/0"][:] = rng.standard_normal((n, t, d)).astype(np.float16)
    group["pos0/0"][:] = rng.standard_normal((n, d)).astype(np.float32)
    group["layers/2"][:] = rng.standard_normal((n, t, d)).astype(np.float32)
    return group


@pytest.mark.parametrize("layer", [0, 2])
def test_contiguous_reads_give_what_oindex_gives_in_any_order(float16_layers, layer):
    array = float16_layers[f"layers/{layer}"]
    rng = np.random.default_rng(1)
    asks = [
        np.arange(30),  # the whole layer: read in place
        np.arange(8, 20),  # whole chunks in order
        rng.permutation(30)[:13],  # scattered, unordered
        np.array([5, 5, 29, 0, 5]),  # repeated, across the ends
        np.zeros(0, dtype=int),
    ]
    for seqs in asks:
        for max_bytes in (256 << 20, 1):  # one run, or one chunk a read
            got = hs.read_stored(float16_layers, layer, seqs, max_bytes=max_bytes)
            want = np.asarray(array.oindex[seqs]) if seqs.size else np.zeros((0, *array.shape[1:]), array.dtype)
            assert got.dtype == array.dtype and got.tobytes() == want.tobytes(), (seqs, max_bytes)


def test_float32_made_where_the_step_runs_is_the_hosts_to_the_bit(float16_layers):
    seqs = np.array([7, 1, 22, 3])
    host = hs.read_sequences(float16_layers, 0, seqs)  # the host's path: scale, float32, position 0 exact
    staged = {k: torch.from_numpy(v) for k, v in feed.stored(float16_layers, 0, seqs, "c").items()}
    assert staged["c"].dtype == torch.float16  # half the bytes travel
    got = feed.as_float(staged, "c", "cpu", hs.layer_scales(float16_layers)[0])
    assert got.dtype == torch.float32 and got.numpy().tobytes() == host.tobytes()
    no_pos0 = feed.stored(float16_layers, 0, seqs, "c", pos0=False)
    assert set(no_pos0) == {"c"}  # a bridge that drops position 0 does not read it


class ReadsBack(TorchDispatchMode):
    """Every read of a tensor's value into Python (`float(t)`, `int(t)`, `.item()`, `.tolist()`): on a GPU each
    one waits for the device. The optimizer's own step counters (CPU tensors in torch.optim) are left out."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            stack = traceback.extract_stack()[:-1]
            if not any("torch/optim" in frame.filename for frame in stack):
                ours = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stack if "dihal" in f.filename]
                self.reads.append(" < ".join(reversed(ours[-3:])))
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_a_training_step_reads_nothing_back_from_the_device(tiny_bridge_extract, monkeypatch):
    """A rotary bridge's steps under a spy on value reads: none between two flushes. Before: the loss's float()
    and finiteness check at every step, and int(positions[-1]) in each rotary block."""
    spy, real = ReadsBack(), trainer.Fit.step

    def step(self, s):
        with spy:
            return real(self, s)

    monkeypatch.setattr(trainer.Fit, "step", step)
    args = ["--layer", "2", "--extract", "latest", *TINY, "--positions", "rotary", "--train-steps", "4"]
    res = invoke("train-bridge", *args)
    assert res.exit_code == 0, res.output
    assert spy.reads == [], spy.reads


def _bridge(root, flush: int, monkeypatch, *extra: str):
    monkeypatch.setattr(trainer, "FLUSH_EVERY", {"cpu": flush})
    args = ["--layer", "2", "--extract", "latest", *TINY, "--train-steps", "12", "--eval-every", "6", *extra]
    return invoke("train-bridge", *args, "--force")


@pytest.mark.slow
def test_losses_read_every_few_steps_log_and_train_as_every_step(tiny_bridge_extract, monkeypatch):
    """As on a GPU (trainer.FLUSH_EVERY): rows logged five at a time hold the same losses and the run the same
    weights as rows logged at every step; a non-finite loss is named at its own step, and nothing of it is
    checkpointed."""
    store = ArtifactStore(tiny_bridge_extract)
    runs = {}
    for flush in (1, 5):
        assert _bridge(tiny_bridge_extract, flush, monkeypatch).exit_code == 0
        art = store.resolve("latest", "bridge")
        rows = files.read_jsonl(art.file("metrics.jsonl"))
        runs[flush] = (
            [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows],
            art.file("weights.safetensors").read_bytes(),
        )
    assert runs[5] == runs[1]
    assert [r["step"] for r in runs[5][0]] == list(range(1, 13)) and "val_loss" in runs[5][0][5]
    every = _bridge(tiny_bridge_extract, 1, monkeypatch, "--lr", "1e30", "--warmup", "1")
    five = _bridge(tiny_bridge_extract, 5, monkeypatch, "--lr", "1e30", "--warmup", "1")
    said = lambda res: next(line for line in res.output.splitlines() if "loss became" in line)
    assert every.exit_code == five.exit_code == 2 and said(five) == said(every), (said(every), five.output)


def test_moments_from_token_counts_are_those_of_every_position():
    from dihal.stages.diffusion.normalizer import RunningMoments, table_moments

    rng = np.random.default_rng(3)
    table = torch.from_numpy(rng.standard_normal((50, 6)).astype(np.float32) * 3 + 1)
    ids = rng.integers(0, 50, (9, 13))
    ids[:, 4] = 7  # one token far more often than the others
    want = RunningMoments(6)
    want.add(table[torch.from_numpy(ids)].numpy())
    got = table_moments(table, ids, rows=8)  # blocks of 8 of the tokens that occur
    assert got.n == want.n and np.allclose(got.mean, want.mean, rtol=1e-12) and np.allclose(got.std(), want.std())


@pytest.mark.slow
def test_the_bridge_reads_one_layer_and_conditions_on_the_backbones_embedding(
    tiny_bridge_extract, tiny_dirs, monkeypatch
):
    """Issue 64 item 1: training reads h_l alone; h_0 is the token's row of the backbone's embedding, so the
    condition's statistics are those of the embedding over the training tokens (here from the model's own
    weights, in float64), not of the float16 extract."""
    from transformers import AutoModelForCausalLM

    from dihal.stages import train_bridge

    layers, real = [], feed.stored
    monkeypatch.setattr(
        feed, "stored", lambda group, layer, *a, **k: layers.append(layer) or real(group, layer, *a, **k)
    )
    args = ["--layer", "2", "--extract", "latest", *TINY, "--train-steps", "4"]
    res = invoke("train-bridge", *args)
    assert res.exit_code == 0, res.output
    assert set(layers) == {2}
    store = ArtifactStore(tiny_bridge_extract)
    group = hs.open_group(store.resolve("latest", "extract"))
    ids = np.asarray(group["input_ids"][:])[hs.split_indices(group, "train")][:, 1:]
    embed = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).get_input_embeddings().weight.detach().double()
    rows = embed[torch.from_numpy(ids).long()].reshape(-1, embed.shape[1]).numpy()
    stats = files.load_tensors(store.resolve("latest", "bridge").file("stats.safetensors"))
    assert np.allclose(stats["mu_c"].numpy(), rows.mean(0), rtol=1e-5, atol=1e-7)
    assert np.allclose(stats["sigma_c"].numpy(), rows.std(0, ddof=1), rtol=1e-5)
    # a table that is not what the extract stored as layer 0 (another backbone's, position embeddings): refused
    monkeypatch.setattr(train_bridge, "layer0_table", lambda extract, cfg: 1.1 * real_table(extract, cfg))
    real_table = train_bridge.frozen_table
    res = invoke("train-bridge", *args, "--seed", "5")
    assert res.exit_code == 2 and "layer 0 of this extract is not the backbone's embedding" in res.output, res.output


def same_curve(a_art, b_art, steps: int, rel: float = 1e-5) -> None:
    """Two trained parts' metrics.jsonl: the same steps, and every train and validation loss equal to `rel`."""
    import json

    curve = lambda art: [
        (r["step"], r.get("train_loss"), r.get("val_loss"))
        for r in map(json.loads, art.file("metrics.jsonl").read_text().splitlines())
    ]
    a, b = curve(a_art), curve(b_art)
    assert [s for s, *_ in a] == [s for s, *_ in b] and len(a) == steps and sum(v is not None for *_, v in a) == 2
    for (_, ta, va), (_, tb, vb) in zip(a, b):
        assert (ta is None) == (tb is None) and (va is None) == (vb is None)
        assert ta is None or ta == pytest.approx(tb, rel=rel)
        assert va is None or va == pytest.approx(vb, rel=rel)


@pytest.mark.slow
def test_states_computed_by_the_backbone_train_the_store_paths_parts_from_token_ids_alone(tiny_dirs, root, monkeypatch):
    """Issue 64 items 1 and 2: --states model takes h_l from the backbone's first l blocks on the training device
    (h_0 from its embedding), over the same sequences in the same order, reading no layer at all: an extract of
    the token ids alone (--layers none) will do. On a float32 store each part's loss curve and validation loss are
    the store path's to float rounding, under another id: the bridge at layer 2, DiHAL-direct's prior over h_2,
    the prior over h_0 (with --token-ce) and the CoDAR decoder. An extract of token ids is refused in one line by
    what must read a layer; so is a layer the backbone does not have."""
    from dihal.stages.lm.capture import hidden_states

    common = ["--model", str(tiny_dirs["llama"]), "--max-sequences", "40", "--seq-len", "16", "--device", "cpu"]
    extract = ["extract", *common, "--val-fraction", "0.2", "--store-dtype", "float32"]
    assert invoke(*extract, "--layers", "0,2").exit_code == 0
    store = ArtifactStore(root)
    full = store.resolve("latest", "extract")
    assert invoke(*extract, "--layers", "none").exit_code == 0
    ids_only = store.resolve("latest", "extract")
    group, bare = hs.open_group(full), hs.open_group(ids_only)
    assert hs.stored_layers(bare) == [] and ids_only.manifest["metrics"]["layers"] == []
    for name in ("input_ids", "attention_mask", "split"):
        assert np.array_equal(np.asarray(group[name][:]), np.asarray(bare[name][:]))
    assert "sample_seq" not in bare  # no pool: the score reads none from it
    layers, real = [], feed.stored
    monkeypatch.setattr(
        feed, "stored", lambda group, layer, *a, **k: layers.append(layer) or real(group, layer, *a, **k)
    )
    recipe = lambda stage: [a for a in TINY if a not in ("--depth", "2")] if stage == "train-decoder" else TINY
    run = lambda stage, *args: invoke(stage, *args, *recipe(stage), "--train-steps", "12", "--eval-every", "6")

    def both(stage: str, *args: str, read: set) -> None:
        layers.clear()
        res = run(f"train-{stage}", *args, "--extract", full.id)
        assert res.exit_code == 0, res.output
        stored = store.resolve("latest", stage)
        assert set(layers) == read and "states" not in stored.config  # the store path's id is the one before
        layers.clear()
        res = run(f"train-{stage}", *args, "--extract", ids_only.id, "--states", "model")
        assert res.exit_code == 0, res.output
        computed = store.resolve("latest", stage)
        assert layers == [] and computed.id != stored.id and computed.config["states"] == "model"
        same_curve(stored, computed, 12)

    both("bridge", "--layer", "2", read={2})
    # what the blocks compute is what the extract stored, here to the bit (same float32 forward, rows alone)
    from dihal.stages.lm.models import load_model

    model = load_model(str(tiny_dirs["llama"]), "cpu", "float32").model
    ids = torch.from_numpy(np.asarray(group["input_ids"][:5]).astype(np.int64))
    assert torch.allclose(hidden_states(model, ids, [2])[2], torch.from_numpy(hs.read_sequences(group, 2, range(5))))
    both("prior", "--layer", "2", read={2})  # DiHAL-direct's prior over h_2
    both("prior", "--layer", "0", "--token-ce", "0.5", read={0})  # Diffusion-LM's, and its token side
    both("decoder", read={0})  # CoDAR's decoder, conditioned on h_0
    lines = lambda res: (res.exit_code, len(res.output.strip().splitlines()))
    res = invoke("train-prior", *TINY, "--extract", ids_only.id, "--states", "model", "--data", "corpus")
    assert lines(res) == (2, 1) and "--states model computes the extract's layer from its token ids" in res.output
    res = run("train-bridge", "--layer", "2", "--extract", ids_only.id)
    assert lines(res) == (2, 1) and "lacks layer 0 (it holds [])" in res.output and "--layers 0,2" in res.output
    res = invoke("score", "--extract", ids_only.id)
    assert lines(res) == (2, 1) and "token ids alone, --layers none" in res.output
    res = invoke(
        "train-bridge", "--layer", "9", *TINY, "--train-steps", "2", "--extract", ids_only.id, "--states", "model"
    )
    assert res.exit_code == 2 and "--states model runs the backbone's first 9 blocks, but it has" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_a_gpu_step_takes_fused_adamw_and_a_gpu_parts_id_says_so():
    """Issue 64 item 4: on a GPU the optimizer is AdamW's fused kernel, which rounds otherwise than the CPU's
    per-tensor AdamW, so a GPU-trained part's id (and a sweep's, confirm's or comparison's, which train parts)
    hashes it; on the CPU the optimizer and every id are as before."""
    from dihal.stages.configs import BridgeConfig, PriorConfig, gpu_key

    net = torch.nn.Linear(3, 3)
    for cls, extra in ((BridgeConfig, {"layer": 2}), (PriorConfig, {})):
        gpu, cpu = cls.from_protocol(None, device="cuda", **extra), cls.from_protocol(None, **extra)
        assert gpu.hashed()["optimizer"] == "adamw, fused" and "optimizer" not in cpu.hashed()
        assert gpu.hashed()["validation_noise"] == "device" and "validation_noise" not in cpu.hashed()
        assert trainer.optimizer(net, gpu, torch.device("cuda:1")).defaults["fused"] is True
        assert not trainer.optimizer(net, cpu, torch.device("cpu")).defaults["fused"]
    assert gpu_key("cpu") == {}


@pytest.mark.slow
def test_a_sweep_of_computed_states_reads_the_score_of_a_small_extract_and_trains_the_store_paths_bridges(
    tiny_dirs, root
):
    """Issue 64 items 2 and 6: the paper protocol's disk plan. The score reads every layer of a small extract;
    the sweep's bridges (--states model) read only the token ids of their own extract, of the same backbone, and
    each layer's bridge and fidelity equal the store path's on an all-layer float32 extract of the same sequences.
    Without --states model a score of another extract stays refused, in one line."""
    import pandas as pd

    common = ["--model", str(tiny_dirs["llama"]), "--seq-len", "16", "--device", "cpu", "--val-fraction", "0.2"]
    extract = ["extract", *common, "--store-dtype", "float32"]
    store = ArtifactStore(root)
    assert invoke(*extract, "--max-sequences", "40", "--layers", "all").exit_code == 0
    full = store.resolve("latest", "extract")
    assert invoke(*extract, "--max-sequences", "40", "--layers", "0").exit_code == 0
    only0 = store.resolve("latest", "extract")
    assert invoke(*extract, "--max-sequences", "24", "--layers", "all").exit_code == 0
    small = store.resolve("latest", "extract")
    assert invoke("score", "--extract", small.id, "--tokens", "100").exit_code == 0
    score = store.resolve("latest", "score")
    sweep = ["sweep", "--layers", "1,2", *TINY, "--train-steps", "6", "--eval-limit", "4", "--device", "cpu"]
    res = invoke(*sweep, "--extract", full.id, "--score", score.id)
    assert res.exit_code == 2 and "was made from extract" in res.output and len(res.output.strip().splitlines()) == 1
    res = invoke(*sweep, "--extract", full.id, "--tokens", "100")
    assert res.exit_code == 0, res.output
    stored = store.resolve("latest", "sweep")
    res = invoke(*sweep, "--extract", only0.id, "--score", score.id, "--states", "model")
    assert res.exit_code == 0, res.output
    computed = store.resolve("latest", "sweep")
    assert computed.id != stored.id and computed.manifest["parents"] == {"extract": only0.id, "score": score.id}
    assert computed.config["overrides"]["states"] == "model" and "states" not in stored.config["overrides"]
    a, b = (pd.read_csv(art.file("sweep_runs.csv")).set_index("layer") for art in (stored, computed))
    for column in ("val_loss", "ppl_ratio", "kl"):
        np.testing.assert_allclose(b[column], a[column], rtol=1e-5)
    for bridge in b["bridge"]:
        assert store.load("bridge", bridge).config["states"] == "model"


@pytest.mark.slow
def test_a_compiled_step_trains_the_eager_bridge_to_rounding_under_its_own_id(tiny_dirs, root):
    """Issue 64 item 4: --compile runs the training step under torch.compile; its kernels round otherwise than
    eager ones, so the bridge has an id of its own, and its loss curve is the eager one's to rounding."""
    make_tiny_extract(tiny_dirs, root)
    train = ["train-bridge", "--layer", "2", *TINY, "--train-steps", "12", "--eval-every", "6", "--extract", "latest"]
    res = invoke(*train)
    assert res.exit_code == 0, res.output
    store = ArtifactStore(root)
    eager = store.resolve("latest", "bridge")
    res = invoke(*train, "--compile")
    assert res.exit_code == 0, res.output
    compiled = store.resolve("latest", "bridge")
    assert compiled.id != eager.id and compiled.config["compile"] is True and "compile" not in eager.config
    same_curve(eager, compiled, 12, rel=1e-4)


@pytest.mark.slow
def test_the_autoencoder_encodes_the_last_layer_read_or_computed_alike_and_refuses_a_shallower_one(tiny_dirs, root):
    """Issue 64 item 2 for the LD4LG-style row: its frozen encoder is the backbone's last layer. Read from an
    all-layer float32 extract or computed by every block from an extract of layer 0 (--states model, as
    compare --states model trains it), the loss curve and the reconstruction are the same to rounding. An
    extract of layer 0 alone is refused in one line: before, the autoencoder silently encoded the deepest stored
    layer, layer 0 of a --states model comparison's extract (seen: compare --states model trained it so)."""
    common = ["--model", str(tiny_dirs["llama"]), "--max-sequences", "40", "--seq-len", "16", "--device", "cpu"]
    extract = ["extract", *common, "--val-fraction", "0.2", "--store-dtype", "float32"]
    store = ArtifactStore(root)
    assert invoke(*extract, "--layers", "all").exit_code == 0
    full = store.resolve("latest", "extract")
    assert invoke(*extract, "--layers", "0").exit_code == 0
    only0 = store.resolve("latest", "extract")
    train = ["train-autoencoder", "--train-steps", "12", "--eval-every", "6", "--width", "16", "--batch-size", "4"]
    res = invoke(*train, "--extract", only0.id)
    assert res.exit_code == 2 and "holds layer 0 alone" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
    res = invoke(*train, "--extract", full.id)
    assert res.exit_code == 0, res.output
    stored = store.resolve("latest", "autoencoder")
    res = invoke(*train, "--extract", only0.id, "--states", "model")
    assert res.exit_code == 0, res.output
    computed = store.resolve("latest", "autoencoder")
    assert computed.config["states"] == "model" and "states" not in stored.config
    blocks = int(full.manifest["metrics"]["num_blocks"])
    for art in (stored, computed):
        assert art.manifest["metrics"]["encoder_layer"] == blocks
    same_curve(stored, computed, 12)
    accuracy = lambda art: art.manifest["metrics"]["reconstruction_accuracy"]
    assert accuracy(computed) == pytest.approx(accuracy(stored), abs=1e-6)


def test_a_layers_moments_are_computed_once_and_read_back_verified(tiny_dirs, root):
    """Issue 64 item 4: the normaliser's statistics of a layer are one artifact per extract and layer
    (stages/moments.py), made by the first part that needs them and read by the next, through the store's
    checksums; the statistics a bridge trains with are the ones Normalizer.fit computes from the store itself."""
    from dihal.artifacts import files
    from dihal.stages.diffusion.normalizer import Normalizer
    from dihal.stages.train_bridge import covered_start

    make_tiny_extract(tiny_dirs, root)
    train = ["train-bridge", "--layer", "2", *TINY, "--train-steps", "2", "--extract", "latest"]
    for seed in ("0", "1"):
        res = invoke(*train, "--seed", seed)
        assert res.exit_code == 0, res.output
    store = ArtifactStore(root)
    (moments,) = store.all("moments")  # two bridges, one layer: one pass
    assert (
        moments.config["layer"] == 2 and moments.manifest["parents"]["extract"] == store.resolve("latest", "extract").id
    )
    bridge = store.resolve("latest", "bridge")
    group = hs.open_group(store.resolve("latest", "extract"))
    fresh = Normalizer.fit(group, 2, 2, hs.split_indices(group, "train"), covered_start(group))
    stats = files.load_tensors(bridge.file("stats.safetensors"))
    assert torch.equal(stats["mu_y"], fresh.mu_y) and torch.equal(stats["sigma_y"], fresh.sigma_y)
    assert torch.equal(stats["pos0"], fresh.pos0)
    path = moments.file("moments.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    res = invoke(*train, "--seed", "2")
    assert res.exit_code == 2 and "moments" in res.output and "Traceback" not in res.output, res.output

"""Paper scale on tiny models: start tokens without BOS (Qwen3), streamed epochs and normalizer,
data-parallel training equal to one process, the KV cache really used, lengths checked."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from dihal.artifacts import files
from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from tests import golden
from tests.conftest import ROOT, invoke, run_cli, torchrun

TINY = ["--protocol", "sweep-tiny", "--width", "16", "--depth", "1", "--heads", "2", "--batch-size", "4"]


@pytest.mark.slow
@pytest.mark.parametrize("kind, start_kind", [("llama", "bos"), ("qwen3", "<|endoftext|>")])
def test_whole_chain_through_the_cli_excludes_position_0(kind, start_kind, tiny_dirs, root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = str(tiny_dirs[kind])
    tok = AutoTokenizer.from_pretrained(model_dir)
    ok = lambda res: res.exit_code == 0 or pytest.fail(res.output)
    ok(
        invoke(
            "extract",
            "--model",
            model_dir,
            "--max-sequences",
            "24",
            "--seq-len",
            "16",
            "--val-fraction",
            "0.25",
            "--device",
            "cpu",
        )
    )
    store = ArtifactStore(root)
    ex = store.resolve("latest", "extract")
    start = ex.manifest["metrics"]["start_token"]
    assert start["kind"] == start_kind and (start_kind != "bos") == (tok.bos_token_id is None)
    group = hs.open_group(ex)
    ids = np.asarray(group["input_ids"][:])
    assert (ids[:, 0] == start["id"]).all() and (ids[:, 1:] != start["id"]).any()

    ok(invoke("score", "--tokens", "100", "--k", "5", "--pairs", "200"))
    positions = np.load(store.resolve("latest", "score").file("positions.npz"))
    assert positions["position"].min() >= 1

    ok(invoke("train-bridge", "--layer", "2", "--extract", ex.id, *TINY, "--train-steps", "6"))
    br = store.resolve("latest", "bridge")
    assert br.manifest["metrics"]["covered_start"] == 1
    stats = files.load_tensors(br.file("stats.safetensors"))
    train = hs.split_indices(group, "train")
    target = hs.read_sequences(group, 2, train).astype(np.float64)  # position 0 exact (float32, kept apart)
    np.testing.assert_allclose(stats["mu_y"].numpy(), target[:, 1:].reshape(-1, 32).mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["pos0"].numpy(), target[:, 0].mean(0), rtol=1e-5, atol=1e-6)

    ok(invoke("evaluate", "--bridge", br.id, "--sample-steps", "2", "--limit", "4", "--device", "cpu"))
    ok(invoke("generate", "--bridge", br.id, "--num-samples", "3", "--max-new-tokens", "15", "--device", "cpu"))
    uncond = store.resolve("latest", "generate")
    ok(
        invoke(
            "generate",
            "--bridge",
            br.id,
            "--prompt",
            "The",
            "--num-samples",
            "2",
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
        )
    )
    rows = [json.loads(line) for line in uncond.file("samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["prompt"] == "" and len(r["token_ids"]) <= 15 for r in rows)
    ok(invoke("evaluate", "--samples", uncond.id, "--json", "--device", "cpu"))
    reported = json.loads(invoke("evaluate", "--samples", uncond.id, "--json", "--device", "cpu").output)["results"][0]

    # Gen.PPL by hand: each text after the start token, every one of its tokens scored once
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    nll, count = 0.0, 0
    for r in rows:
        text_ids = tok(r["text"], add_special_tokens=False)["input_ids"]
        if not text_ids:
            continue
        full = torch.tensor([[start["id"], *text_ids]])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0, :-1].float(), -1)
        nll -= float(logp.gather(-1, full[0, 1:, None]).sum())
        count += len(text_ids)
    assert reported["gen_ppl_token"] == pytest.approx(float(np.exp(nll / count)), rel=1e-4)


def test_generation_longer_than_the_bridge_is_refused_up_front(tiny_dirs, root):
    assert (
        invoke(
            "extract",
            "--model",
            str(tiny_dirs["llama"]),
            "--max-sequences",
            "12",
            "--seq-len",
            "16",
            "--layers",
            "0,2",
            "--val-fraction",
            "0.25",
            "--device",
            "cpu",
        ).exit_code
        == 0
    )
    learned = ["--positions", "learned"]  # a rotary bridge (the default) runs to the backbone's context
    assert (
        invoke("train-bridge", "--layer", "2", "--extract", "latest", *TINY, *learned, "--train-steps", "2").exit_code
        == 0
    )
    full = invoke("generate", "--num-samples", "1", "--max-new-tokens", "16", "--device", "cpu")
    assert full.exit_code == 0, full.output  # the start token + 16 new tokens: 16 positions fed
    res = invoke("generate", "--num-samples", "1", "--max-new-tokens", "17", "--device", "cpu")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert (
        res.output.strip()
        .splitlines()[-1]
        .startswith(
            "error: the start token and prompt (1 tokens) plus "
            "--max-new-tokens 17 need 17 positions, but the bridge covers 16"
        )
    )


def test_cached_decoding_equals_full_forward_logits(tiny_dirs):
    """Fails on a transformers that silently ignores the `cache=` keyword (before 5.24): each step
    would then be predicted without its context."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        kv = DynamicCache(config=model.config)
        steps = [model(input_ids=ids[:, :5], cache=kv, use_cache=True).logits]
        steps += [model(input_ids=ids[:, p : p + 1], cache=kv, use_cache=True).logits for p in range(5, 12)]
    assert kv.get_seq_length() == 12
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_streaming_moments_equal_two_pass_float64_and_normalizer_reads_in_blocks(tmp_path):
    from dihal.stages.diffusion.normalizer import Normalizer, RunningMoments

    rng = np.random.default_rng(3)
    x = rng.normal(1000.0, 0.01, size=(999, 7))  # large mean, tiny spread: a naive one-pass formula fails
    moments = RunningMoments(7)
    for block in np.array_split(x, 13):
        moments.add(block)
    np.testing.assert_allclose(moments.mean, x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(moments.std(), x.std(0, ddof=1), rtol=1e-9)

    n, t, d = 23, 6, 5
    states = {0: rng.normal(3, 2, size=(n, t, d)), 2: rng.normal(-50, 0.5, size=(n, t, d))}
    group = hs.create(tmp_path / "h.zarr", [0, 2], n, t, d, {0: "float32", 2: "float32"}, 4, {})
    for layer, values in states.items():
        group[f"layers/{layer}"][:] = values.astype(np.float32)
    seqs = np.array([0, 1, 2, 5, 6, 7, 8, 9, 15, 16, 22])
    norm = Normalizer.fit(group, 0, 2, seqs, start=1, block_bytes=3 * t * d * 4)  # runs of <= 3 sequences
    y = states[2].astype(np.float32).astype(np.float64)[seqs]
    c = states[0].astype(np.float32).astype(np.float64)[seqs]
    np.testing.assert_allclose(norm.mu_y.numpy(), y[:, 1:].reshape(-1, d).mean(0), rtol=1e-6)
    np.testing.assert_allclose(norm.sigma_y.numpy(), y[:, 1:].reshape(-1, d).std(0, ddof=1), rtol=1e-6)
    np.testing.assert_allclose(norm.sigma_c.numpy(), c[:, 1:].reshape(-1, d).std(0, ddof=1), rtol=1e-6)
    np.testing.assert_allclose(norm.pos0.numpy(), y[:, 0].mean(0), rtol=1e-6)


def loop(*, every: int, **settings):
    """The loop's settings of the schedule tests: a constant lr without warm-up, validation and checkpoint
    every `every` steps; steps, epochs, batch and shuffle window given."""
    from dihal.stages.diffusion.trainer import LoopConfig

    fixed = dict(lr=1e-3, warmup=0, schedule="constant", ema=0.9)
    return LoopConfig(**fixed, **settings, eval_every=every, checkpoint_every=every)


def test_epochs_visit_every_sequence_once_in_a_seeded_chunk_local_order():
    from dihal.stages.diffusion.trainer import Schedule, epoch_order

    n, chunk, window = 103, 8, 24
    first, again, other = (epoch_order(n, chunk, window, s, e) for s, e in ((0, 0), (0, 0), (0, 1)))
    assert sorted(first) == list(range(n)) and np.array_equal(first, again) and not np.array_equal(first, other)
    aligned = epoch_order(96, chunk, window, 0, 0)  # whole chunks and windows: 4 windows of 24 sequences
    for start in range(0, 96, window):  # each window draws on window / chunk storage chunks only
        assert len(np.unique(aligned[start : start + window] // chunk)) == window // chunk
    cfg = loop(steps=None, epochs=2, batch_size=10, every=5, shuffle_window=window)
    schedule = Schedule(n, chunk, cfg)
    assert schedule.total == 2 * 11
    seen = np.concatenate([schedule.items(s) for s in range(schedule.total)])
    assert np.array_equal(seen[:n], epoch_order(n, chunk, window, 0, 0))
    assert np.array_equal(seen[n:], epoch_order(n, chunk, window, 0, 1))


def test_loader_serves_exactly_the_scheduled_sequences(tmp_path):
    from dihal.stages.diffusion.trainer import Loader, Schedule

    n, t, d = 30, 4, 3
    group = hs.create(tmp_path / "h.zarr", [0], n, t, d, {0: "float32"}, 4, {})
    group["layers/0"][:] = np.arange(n * t * d, dtype=np.float32).reshape(n, t, d)

    class Task:
        n_train, chunk = n, 4

        def read(self, positions, alloc=None):
            return {"x": hs.read_sequences(group, 0, positions)}

    cfg = loop(steps=9, epochs=None, batch_size=7, every=5, shuffle_window=8)
    schedule = Schedule(n, 4, cfg)
    for rank in range(2):
        loader = Loader(Task(), schedule, rank, 2, first_step=2)
        for step in range(2, 9):
            slots, batch = loader.batch(step)
            want = schedule.items(step)[rank::2]
            np.testing.assert_array_equal(batch["x"][:, 0, 0], want * t * d)
            assert np.array_equal(slots, np.arange(len(schedule.items(step)))[rank::2])
        loader.close()


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_reading_the_store_take_their_own_chunks_and_read_a_share_of_them(tmp_path, world):
    """issue 64 item 4: a task that reads stored layers deals the chunks of each shuffle window to the ranks
    (the k-th to rank k mod W); each rank trains on the items of its own chunks, every item of every step is
    trained by exactly one rank, and a rank reads its own chunks alone (plus item 0 of a step it has no item
    in, at weight 0): a 1/W share, where items dealt r, r + W, ... read every chunk on every rank."""
    from dihal.stages.diffusion.trainer import Loader, Schedule

    n, t, d, chunk = 64, 4, 3, 4
    group = hs.create(tmp_path / "h.zarr", [0], n, t, d, {0: "float32"}, chunk, {})
    group["layers/0"][:] = np.arange(n * t * d, dtype=np.float32).reshape(n, t, d)

    class Task:
        n_train = n

        def __init__(self, stored):
            self.chunk, self.stored, self.read_positions = chunk, stored, []

        def read(self, positions, alloc=None):
            self.read_positions.append(np.asarray(positions))
            return {"x": hs.read_sequences(group, 0, positions)}

    cfg = loop(steps=8, epochs=None, batch_size=8, every=8, shuffle_window=16)  # 16 chunks, 4 a window, 2 steps a block
    schedule = Schedule(n, chunk, cfg)
    trained, chunks_read = {}, {}
    for rank in range(world):
        for stored in (True, False):
            task = Task(stored)
            loader = Loader(task, schedule, rank, world, first_step=0)
            for step in range(8):
                slots, batch = loader.batch(step)
                np.testing.assert_array_equal(batch["x"][:, 0, 0], schedule.items(step)[slots] * t * d)
                if stored and loader.weight(step):
                    trained.setdefault(step, []).extend(slots.tolist())
            loader.close()
            chunks_read[rank, stored] = set((np.concatenate(task.read_positions) // chunk).tolist())
    for step in range(8):  # every item of the global batch once, over the ranks
        assert sorted(trained[step]) == list(range(8)), step
    own = [set(), set()]
    for step in range(8):
        owners = schedule.owners(step, world)
        for rank in range(world):
            items = schedule.items(step)
            slots = np.flatnonzero(owners == rank)
            assert (schedule.owners(step, world)[slots] == rank).all()
            own[0] |= {(rank, int(c)) for c in items[slots] // chunk}
            if slots.size == 0:  # item 0 at weight 0
                own[0] |= {(rank, int(items[0] // chunk))}
    for rank in range(world):
        assert chunks_read[rank, True] == {c for r, c in own[0] if r == rank}
        assert len(chunks_read[rank, True]) <= 16 // world + 2  # its share, and at most two chunks at weight 0
        # dealt r, r + W, ...: most chunks on every rank (15-16 of 16 at W = 2, 10-13 at W = 4, this seed)
        assert len(chunks_read[rank, False]) >= 1.8 * (16 // world)
    # the chunks of each window go one rank each: no chunk trained by two ranks
    owners_of = {}
    for step in range(8):
        for slot, rank in enumerate(schedule.owners(step, world)):
            owners_of.setdefault(int(schedule.items(step)[slot] // chunk), set()).add(int(rank))
    assert all(len(r) == 1 for r in owners_of.values()) and len(owners_of) == 16


def _extract(tiny_dirs, root) -> None:
    """40 sequences of 16 tokens, layers 0 and 2, in one process (what every torchrun test starts from)."""
    args = [
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--max-sequences",
        "40",
        "--seq-len",
        "16",
        "--layers",
        "0,2",
        "--val-fraction",
        "0.2",
        "--device",
        "cpu",
        "--root",
        str(root),
    ]
    run_cli(*args, env={"OMP_NUM_THREADS": "1"}, check=True)


TINY_PART = [
    "--protocol",
    "sweep-tiny",
    "--width",
    "16",
    "--depth",
    "1",
    "--heads",
    "2",
    "--batch-size",
    "8",
    "--train-steps",
    "8",
    "--eval-every",
    "4",
    "--seed",
    "3",
    "--device",
    "cpu",
]


def _bridge_args(root) -> list[str]:
    return ["train-bridge", "--layer", "2", "--extract", "latest", *TINY_PART, "--root", str(root)]


@pytest.mark.slow
def test_two_ranks_train_the_same_bridge_as_one_process(tiny_dirs, tmp_path):
    """Tolerance: per-step training loss within 1e-4 relative and EMA weights within 1e-5; the only
    difference is the order in which gloo sums the two ranks' gradients. Rank 1's device is cpu:1
    (tests/rank_devices.py), as a GPU rank's is cuda:1: the id must not see it."""
    single, dist = tmp_path / "single", tmp_path / "dist"
    _extract(tiny_dirs, single)
    shutil.copytree(single, dist)
    run_cli(*_bridge_args(single), env={"OMP_NUM_THREADS": "1"}, check=True)
    two = torchrun(*_bridge_args(dist))
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = ArtifactStore(single).resolve("latest", "bridge"), ArtifactStore(dist).all("bridge")
    assert [x.id for x in b] == [a.id] and b[0].complete, "both ranks must write one artifact, with one id"
    b = b[0]
    assert b.manifest["metrics"]["world_size"] == 2 and a.manifest["metrics"]["world_size"] == 1
    assert b.manifest["environment"]["world_size"] == 2 and b.config["device"] == "cpu"
    log_a, log_b = files.read_jsonl(a.file("metrics.jsonl")), files.read_jsonl(b.file("metrics.jsonl"))
    assert [r["step"] for r in log_b] == list(range(1, 9))
    np.testing.assert_allclose([r["train_loss"] for r in log_b], [r["train_loss"] for r in log_a], rtol=1e-4)
    wa, wb = (
        files.load_tensors(a.file("weights_ema.safetensors")),
        files.load_tensors(b.file("weights_ema.safetensors")),
    )
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=1e-5, rtol=1e-4)


STAGES = {
    "train-bridge": "bridge",
    "train-prior": "prior",
    "train-decoder": "decoder",
    "train-autoencoder": "autoencoder",
}


@pytest.mark.slow
def test_every_stage_under_torchrun_writes_one_artifact_with_one_id(tiny_dirs, tmp_path):
    """Every stage command on two ranks whose devices are cpu:0 and cpu:1 (as cuda:0 and cuda:1 on a GPU
    node), in order in one launch (scripts/reproduce_paper.sh's test launches each of its commands anew): each
    makes exactly one complete artifact, with the id one process gives it, whose config names
    the device type only. A stage that splits its work (extract, the trainers) runs on both ranks; every
    other one on rank 0 while rank 1 waits for its artifact. Before: rank 1 hashed `cpu:1` into its own
    id, and score, evaluate, generate and compare died on the lock (issue 46)."""
    root, single = tmp_path / "runs", tmp_path / "single"
    args = ["--model", str(tiny_dirs["llama"]), "--max-sequences", "40", "--seq-len", "16", "--layers", "0-3"]
    args += ["--val-fraction", "0.2", "--device", "cpu"]
    no_depth = [a for i, a in enumerate(TINY_PART) if "--depth" not in TINY_PART[max(i - 1, 0) : i + 1]]
    commands = [
        ("extract", args),
        ("score", ["--tokens", "100", "--k", "4", "--pairs", "50", "--candidates", "1,2,3"]),
        ("train-bridge", ["--layer", "2", "--extract", "latest", *TINY_PART]),
        ("train-prior", TINY_PART),
        ("train-decoder", no_depth),  # the decoder's depth is fixed
        ("train-autoencoder", ["--train-steps", "3", "--width", "16", "--batch-size", "4"]),
        ("evaluate", ["--bridge", "latest", "--sample-steps", "2", "--limit", "3", "--device", "cpu"]),
        ("generate", ["--bridge", "latest", "--num-samples", "2", "--max-new-tokens", "4", "--device", "cpu"]),
        ("evaluate", ["--samples", "latest", "--device", "cpu"]),
        ("generate", ["--mode", "parallel", "--prior", "latest", "--num-samples", "2", "--device", "cpu"]),
        (
            "sweep",
            ["--extract", "latest", "--score", "latest", "--layers", "1,2", *TINY_PART[:-2], "--eval-limit", "2"],
        ),
        (
            "confirm",
            ["--protocol", "sweep-tiny", "--train-steps", "3", "--width", "16", "--depth", "1", "--seeds", "0"]
            + ["--num-samples", "2", "--eval-limit", "2", "--sample-steps", "2", "--evaluator", str(tiny_dirs["qwen3"])]
            + ["--device", "cpu"],
        ),
    ]
    plan = tmp_path / "commands.json"  # one torchrun launch runs them in order (a launch costs a 2-core machine ~8 s)
    plan.write_text(json.dumps([[command, *extra, "--root", str(root)] for command, extra in commands]))
    proc = torchrun("--each", str(plan), timeout=600)
    after = [json.loads(line) for line in (tmp_path / "commands.jsonl").read_text().splitlines()]
    assert proc.returncode == 0 and len(after) == len(commands), proc.stderr[-3000:]
    store, before = ArtifactStore(root), set()
    for (command, extra), now in zip(commands, after):
        assert now["code"] == 0, command
        made = [store.load(s, i) for s, i in now["made"] if i not in before and s == STAGES.get(command, command)]
        before |= {i for _, i in now["made"]}
        assert len(made) == 1 and made[0].complete, f"{command}: {[(a.stage, a.id, a.status) for a in made]}"
        assert ":" not in str(made[0].config.get("device")), made[0].config  # the type, never cpu:1
        one = invoke(command, *extra, "--root", str(single))  # the same command in one process (this one): the same id
        assert one.exit_code == 0, (command, one.output[-3000:])
        assert made[0].id in {a.id for a in ArtifactStore(single).all(made[0].stage)}, command
        # and the same content (issue 63): the ids hash configs, so a rank that read the wrong rows would pass
        # on ids alone. Every value within the golden records' tolerance (tests/golden.py); tokens and ids exactly
        alone = ArtifactStore(single).load(made[0].stage, made[0].id)
        moved = golden.differences(golden.view(made[0]), golden.view(alone), golden.RANK_SPLIT + made[0].stage)
        assert not moved, (command, moved[:4])
        if command.startswith("train-"):
            assert made[0].manifest["metrics"]["world_size"] == 2
            steps = [r["step"] for r in files.read_jsonl(made[0].file("metrics.jsonl"))]
            assert steps == list(range(1, len(steps) + 1))
    assert ArtifactStore(root).resolve("latest", "extract").manifest["world_size"] == 2


@pytest.mark.slow
def test_bfloat16_autocast_trains_on_cpu(tiny_dirs, root):
    assert (
        invoke(
            "extract",
            "--model",
            str(tiny_dirs["llama"]),
            "--max-sequences",
            "12",
            "--seq-len",
            "16",
            "--layers",
            "0,2",
            "--val-fraction",
            "0.25",
            "--device",
            "cpu",
        ).exit_code
        == 0
    )
    res = invoke(
        "train-bridge",
        "--layer",
        "2",
        "--extract",
        "latest",
        *TINY,
        "--train-steps",
        "4",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
    )
    assert res.exit_code == 0, res.output
    art = ArtifactStore(root).resolve("latest", "bridge")
    assert art.config["precision"] == "bfloat16" and np.isfinite(art.manifest["metrics"]["val_loss"])
    weights = files.load_tensors(art.file("weights.safetensors"))
    assert all(w.dtype == torch.float32 for w in weights.values())  # autocast: the weights stay float32


@pytest.mark.slow
def test_sweep_scores_every_candidate_and_refuses_a_foreign_score(tiny_dirs, root):
    ex_args = [
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--max-sequences",
        "16",
        "--seq-len",
        "16",
        "--val-fraction",
        "0.25",
        "--device",
        "cpu",
    ]
    assert invoke(*ex_args).exit_code == 0
    store = ArtifactStore(root)
    first = store.resolve("latest", "extract")
    res = invoke(
        "sweep",
        "--extract",
        first.id,
        "--layers",
        "1,2",
        "--tokens",
        "100",
        "--train-steps",
        "2",
        "--width",
        "16",
        "--depth",
        "1",
        "--batch-size",
        "4",
        "--eval-limit",
        "2",
        "--device",
        "cpu",
    )
    assert res.exit_code == 0, res.output
    score = store.resolve("latest", "score")
    assert score.manifest["metrics"]["candidates"] == [1, 2, 3]  # z-scores over 1..L-1, not the swept subset
    assert invoke(*ex_args, "--seed", "1").exit_code == 0
    other = store.resolve("latest", "extract")
    res = invoke(
        "sweep",
        "--extract",
        other.id,
        "--score",
        score.id,
        "--layers",
        "1,2",
        "--train-steps",
        "2",
        "--width",
        "16",
        "--depth",
        "1",
        "--batch-size",
        "4",
        "--device",
        "cpu",
    )
    assert res.exit_code == 2 and f"score {score.id} was made from extract {first.id}" in res.output


@pytest.mark.slow
def test_a_sweep_under_torchrun_shards_layers_over_ranks(tiny_dirs, tmp_path):
    """Each (layer, seed) bridge is trained once, by one rank, and rank 0 finds the others' in the
    store: with rank 1 on cpu:1, its bridges must have the ids rank 0 looks for."""
    args = [
        "sweep",
        "--model",
        str(tiny_dirs["llama"]),
        "--max-sequences",
        "16",
        "--seq-len",
        "16",
        "--layers",
        "1,2",
        "--tokens",
        "100",
        "--train-steps",
        "3",
        "--width",
        "16",
        "--depth",
        "1",
        "--batch-size",
        "4",
        "--eval-limit",
        "2",
        "--seeds",
        "0,1",
        "--device",
        "cpu",
        "--root",
        str(tmp_path / "runs"),
    ]
    proc = torchrun(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = ArtifactStore(tmp_path / "runs")
    bridges = store.all("bridge")
    assert sorted((b.config["layer"], b.config["seed"]) for b in bridges) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(b.complete and b.manifest["metrics"]["world_size"] == 1 for b in bridges)  # each by one rank
    for b in bridges:  # trained once: three steps, never resumed or started again by another rank
        assert [r["step"] for r in files.read_jsonl(b.file("metrics.jsonl"))] == [1, 2, 3] and not b.manifest["resumed"]
    # units (layer, seed) in order (1,0) (1,1) (2,0) (2,1), dealt round-robin: rank 1 takes the second and the
    # fourth; each is named once in the log, with its rank, and its fidelity is measured by that rank (issue 65)
    for (layer, seed), rank in zip([(1, 0), (1, 1), (2, 0), (2, 1)], [0, 1, 0, 1]):
        unit = f"layer {layer}, seed {seed}: bridge under protocol"
        named = [line for line in proc.stderr.splitlines() if unit in line]
        assert len(named) == 1 and named[0].endswith(f"and its fidelity (rank {rank})"), named
    fidelities = store.all("evaluate")
    assert len(fidelities) == 4 and all(f.complete for f in fidelities)
    assert sorted(s.config["normalize"] for s in store.all("score")) == ["none", "rms", "standardize"]
    sweep = store.resolve("latest", "sweep")
    assert sweep.complete and sweep.manifest["metrics"]["layers"] == [1, 2]


@pytest.mark.slow
def test_a_killed_data_parallel_run_resumes_to_the_uninterrupted_weights(tiny_dirs, tmp_path):
    """Rank 0 is SIGKILLed after 6 of 8 steps (8 steps checkpoint every step: at least five a run);
    torchrun takes rank 1 down. The same command resumes both ranks at step 6 (a rank that started
    again at 0 would wait for the other forever: the timeout catches that) and ends where an
    uninterrupted two-rank run ends."""
    first, again = tmp_path / "first", tmp_path / "again"
    _extract(tiny_dirs, first)
    shutil.copytree(first, again)
    killed = torchrun(*_bridge_args(first), kill_after=6)
    assert killed.returncode != 0
    (partial,) = ArtifactStore(first).all("bridge")
    assert partial.status == "running" and files.load_state(partial.path)["step"] == 6
    resumed = torchrun(*_bridge_args(first), timeout=180)
    assert resumed.returncode == 0 and "resuming bridge L2 training at step 6" in resumed.stderr, resumed.stderr[-2000:]
    (done,) = ArtifactStore(first).all("bridge")
    assert [r["step"] for r in files.read_jsonl(done.file("metrics.jsonl"))] == list(range(1, 9))
    whole = torchrun(*_bridge_args(again))
    assert whole.returncode == 0, whole.stderr[-2000:]
    a = files.load_tensors(done.file("weights_ema.safetensors"))
    b = files.load_tensors(ArtifactStore(again).resolve("latest", "bridge").file("weights_ema.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_an_indexed_device_under_torchrun_is_one_line_and_ids_record_the_type(monkeypatch, tiny_dirs, root):
    from dihal.stages.runtime import dist

    base = ["extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "8", "--dry-run"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    res = invoke(*base, "--device", "cuda:1")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.output.strip().splitlines()[-1] == (
        "error: --device cuda:1 under torchrun would put every rank on one GPU; give --device cuda "
        "(rank r takes the GPU of its LOCAL_RANK)"
    )
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert dist.device_type("cuda:3") == "cuda" and dist.join("cpu") == "cpu"
    for bad, says in (("cuda:x", "unknown --device 'cuda:x'"), ("cpu:1", "unknown --device 'cpu:1'")):
        res = invoke(*base, "--device", bad)
        assert res.exit_code == 2 and says in res.output
    for value in ("0", "-5", "nan", "inf"):
        res = invoke("--dist-timeout", value, *base)
        assert res.exit_code == 2 and "--dist-timeout must be a positive number of minutes" in res.output


def test_a_missing_gpu_index_is_one_line(monkeypatch):
    from dihal.artifacts.errors import DihalError
    from dihal.stages.lm import models

    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(models.torch.cuda, "device_count", lambda: 2)
    assert models.resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(DihalError, match=r"--device cuda:2 asked for, but torch sees 2 GPU\(s\): cuda:0..cuda:1"):
        models.resolve_device("cuda:2")
    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: False)
    with pytest.raises(DihalError, match="torch sees no CUDA device; use --device cpu"):
        models.resolve_device("cuda")


@pytest.mark.slow
def test_decoder_validation_memory_is_bounded_whatever_the_vocabulary(tmp_path):
    """The old validation built (64, 63, V) float32 logits at once (33 GB at the paper protocol's 512 x
    127 x 128,256). Measured as peak RSS in a fresh process at V = 65,536 (benchmarks/
    bench_decoder_memory.py): the old path's growth is at least the logits' size (so the measurement
    sees it), the sliced one's is a quarter of that or less, and both give the same loss."""
    from benchmarks.bench_decoder_memory import measure

    vocab, sequences = 65536, 64
    logits_bytes = sequences * 63 * vocab * 4
    old, new = (measure(path, sequences, 64, vocab, tmp_path / path) for path in ("old", "new"))
    assert old["peak_growth_bytes"] >= logits_bytes, old
    assert new["peak_growth_bytes"] * 4 <= logits_bytes, new
    assert new["loss"] == pytest.approx(old["loss"], rel=1e-5)


def test_cpu_draws_are_the_per_item_generators_every_cpu_artifact_was_trained_with():
    """A CPU artifact's id keeps meaning the same weights: item j of step s still draws from
    torch.Generator().manual_seed(seed * 1_000_003 + s * 4099 + j), in the order t, noise, condition."""
    from dihal.stages.diffusion.draws import ItemDraws, for_step

    seed, step, slots = 3, 17, np.array([0, 2, 5])
    draws = for_step(seed, step, slots, 6, torch.device("cpu"))
    assert isinstance(draws, ItemDraws)
    t, eps = draws.rand(), draws.randn(4, 2)
    for row, j in enumerate(slots):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + int(j))
        assert torch.equal(t[row], torch.rand((), generator=gen))
        assert torch.equal(eps[row], torch.randn((4, 2), generator=gen))


def test_device_draws_split_over_ranks_as_one_process_draws_them():
    """On a GPU one generator per process draws the global batch on the device (here run on the CPU
    device): the ranks' rows together are one process's, and a step's draws repeat (a resume)."""
    from dihal.stages.diffusion.draws import DeviceDraws

    whole = DeviceDraws(3, 17, np.arange(6), 6, "cpu")
    t, eps = whole.rand(), whole.randn(5, 4)
    for rank in range(2):
        mine = DeviceDraws(3, 17, np.arange(6)[rank::2], 6, "cpu")
        assert torch.equal(mine.rand(), t[rank::2]) and torch.equal(mine.randn(5, 4), eps[rank::2])
    other = DeviceDraws(3, 18, np.arange(6), 6, "cpu")
    assert not torch.equal(other.rand(), t)
    again = DeviceDraws(3, 17, np.arange(6), 6, "cpu")
    assert torch.equal(again.rand(), t) and torch.equal(again.randn(5, 4), eps)


@pytest.mark.parametrize("like", ["llama-3.1-8b", "qwen3-8b"])
def test_the_estimate_counts_the_parameters_of_the_models_it_estimates(like):
    """scripts/estimate.py's sizes rest on two counts: the backbone's parameters, from the published
    config that scripts/make_random_model.py holds (8.03B and 8.19B), and the denoiser's, from the
    paper protocol's width and depth. Both are checked against the real modules (built on the meta
    device: no memory)."""
    import argparse

    from transformers import AutoConfig, AutoModelForCausalLM

    from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
    from tests.conftest import load_script

    estimate, models = load_script("estimate"), load_script("make_random_model")
    config = AutoConfig.for_model(**models.LIKE[like])
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    args = argparse.Namespace(like=like, blocks=None, width=None, vocab=None, intermediate=None, params=None)
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size + 2 * config.num_hidden_layers * 128 * (
        like == "qwen3-8b"
    )  # RMSNorm weights (and Qwen3's q/k norms), which the estimate leaves out
    assert estimate.shapes(args)["params"] == real - norms
    with torch.device("meta"):
        den = Denoiser(DenoiserConfig(dim=4096, width=1024, depth=8, heads=16, max_len=127))
    counted = estimate.denoiser_parameters(1024, 4096, 8)
    assert abs(sum(p.numel() for p in den.parameters()) - counted) / counted < 0.01


def test_a_gpu_rank_loads_its_weights_straight_onto_its_own_device(tiny_dirs, monkeypatch):
    """Under torchrun `cuda` is the rank's GPU (dist.join makes it current): the weights are loaded onto it by
    from_pretrained's device_map, never the whole model into host memory first (8 ranks x 16 GB at once on
    an 8-GPU node). The GPU is stood in for: torch's current device says 3, and the load happens on the CPU."""
    import transformers

    from dihal.stages.lm import models

    asked, real = {}, transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        asked.update(kwargs)
        return real(*args, **{k: v for k, v in kwargs.items() if k != "device_map"})

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setattr(models, "resolve_device", lambda device, check=True: device)
    monkeypatch.setattr(models, "check_runs", lambda device, dtype: torch.float32)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(models, "wrap_model", lambda model, tok, identity: model)
    models.load_model(str(tiny_dirs["llama"]), "cuda")
    assert asked["device_map"] == {"": "cuda:3"}
    asked.clear()
    models.load_model(str(tiny_dirs["llama"]), "cpu")
    assert "device_map" not in asked


@pytest.mark.slow
def test_the_gpu_profile_rehearses_on_the_cpu(tmp_path):
    """scripts/gpu_profile.sh as the next GPU session runs it, on the CPU (issue 64 item 5): a random Llama-shaped
    model, its extract, then the paper bridge (from the store and from states the backbone computes) and prior
    trained under the profiler; one line each with its throughput and data wait, and each part's table of
    kernels; then the hybrid's generation against the backbone's (issue 65 item 3), one line per batch."""
    import re

    env = {**os.environ, "DEVICE": "cpu", "DTYPE": "float32", "DIHAL_ROOT": str(tmp_path / "runs")}
    proc = subprocess.run(["bash", "scripts/gpu_profile.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for part in ("bridge, store", "bridge, model", "prior"):
        row = re.search(rf"^{re.escape(part)} +([\d,]+) +([\d,]+) +n/a +([\d.]+)% +n/a$", proc.stdout, re.M)
        assert row and int(row[2].replace(",", "")) > 0 and 0 <= float(row[3]) <= 100, proc.stdout[-3000:]
        assert f"== {part}: the 15 costliest kernels" in proc.stdout
    for batch in (1, 8):
        row = re.search(rf"^ +{batch} +([\d,.]+) +([\d,.]+) +([\d.]+)$", proc.stdout, re.M)
        assert row and float(row[1].replace(",", "")) > 0 and float(row[3]) > 0, proc.stdout[-3000:]


@pytest.mark.slow
def test_the_estimate_counts_a_bridges_reads_once_and_one_layer_of_them():
    """issue 64 item 6: the measured training rate already includes reads from the page cache and the loader
    reads ahead, so a bridge's time is the slower of its compute and its disk reads, never their sum; and it
    reads layer l alone (h_0 comes from the token ids), twice: the normaliser's pass and the epoch."""

    n_train, tokens = int(20000 * 0.9), 282 * 64 * 127  # the defaults: 20,000 sequences of 128, batch 64
    for disk in (0.01, 1000.0):
        out = _estimate("--disk-gibps", str(disk), "--states", "store")
        row = next(line for line in out.splitlines() if line.startswith("train-bridge (one layer)"))
        read_s = 2 * n_train * 128 * 4096 * 2 / 2**30 / disk
        assert float(row.split()[6]) == round(max(tokens / 14500, read_s) / 60), (disk, row)


@pytest.mark.slow
def test_the_estimate_on_eight_gpus_deals_compares_units_and_is_a_fifth_of_one_gpus():
    """issue 65 item 4: `--gpus 1,8` prints the protocol on one GPU and on eight. On eight, compare's 162
    part-epochs (27 parts at budget 1, 27 at budget 5) are dealt by dist.deal: the busiest GPU trains 21 of
    them (the fewest possible: 162 / 8 rounds up to 21 with whole epochs), and its 168 generations split
    evenly, an eighth each; the protocol takes at most a fifth of one GPU's time."""

    out = _estimate("--gpus", "1,8", "--states", "store")
    one, eight = out.split("8 GPUs of one node")[0], out.split("8 GPUs of one node")[1]
    compare_1 = next(x for x in one.splitlines() if x.startswith("compare"))
    compare_8 = next(x for x in eight.splitlines() if x.startswith("compare"))
    epoch = 282 * 64 * 127 / 14500 / 60  # one part-epoch on one GPU alone, minutes
    generation = float(compare_1.split()[4]) - 162 * epoch  # compare's sampling and scoring on one GPU
    assert float(compare_8.split()[4]) == pytest.approx(21 * epoch + generation / 8, abs=1)
    total = lambda block: float(next(x for x in block.splitlines() if x.startswith("peak")).split()[-1])
    assert total(eight) <= total(one) / 5, (total(one), total(eight))
    ratio = float(out.split("8 GPUs: ")[1].split(" of one GPU's time")[0])
    assert ratio == pytest.approx(total(eight) / total(one), abs=0.01) and ratio <= 0.2
    assert "measured" in out and "assumed" in out  # every rate says where it comes from


@pytest.mark.slow
def test_the_estimate_prints_each_sources_disk_and_the_computed_states_fit_a_gpu_nodes():
    """issue 64 item 2: a bridge's h_l from the store needs every layer of the 20,000 sequences on disk; computed
    by the backbone (--states model) it needs their token ids alone (--layers none) and, for the score, layer 0
    of 1,024 and every layer at the pool (--keep pool): by hand, float16 at Llama-3.1-8B's width over its 33
    layers."""

    out = _estimate("--gpus", "1")
    disk = {
        name: float(line[30:39])
        for line in out.splitlines()
        for name in ("store", "model (--states model)")
        if line.startswith(name + " ")
    }
    # one sequence of one layer, GiB: 128 float16 states, and its position 0 kept apart in float32
    row, pool = (128 * 4096 * 2 + 4096 * 4) / 2**30, 16384 * 4096 * 2 * 33 / 2**30
    assert disk["store"] == pytest.approx(20000 * 33 * row + pool, rel=0.02)
    ids = 20000 * (128 * 5 + 1) / 2**30  # int32 ids, int8 mask, the split
    # the score's pool over 32 chunks of 32 sequences, each padded to the quota of a chunk of train sequences alone
    padded = 32 * math.ceil(16384 / 32 / 0.9) * 4096 * 2 * 33 / 2**30
    by_hand = ids + 1024 * row + padded  # the token ids; the score's layer 0 and every layer's pool
    assert disk["model (--states model)"] == pytest.approx(by_hand, rel=0.03) and disk["model (--states model)"] <= 8


@pytest.mark.slow
def test_the_estimate_with_computed_states_counts_the_blocks_each_part_runs_and_every_kept_part_on_disk():
    """issue 64 items 2 and 6, reproduce_paper.sh's default (--states model, --keep pool, --keep-weights
    ema-bfloat16): the extract is the score's (layer 0 of 1,024 sequences and every layer at the pool) and the
    token ids of all; a bridge at l* = 3 adds the first 3 of 32 blocks over its training sequences twice (the
    normaliser's pass and the epoch) at the forward rate, split over the ranks; a complete part keeps 2 bytes a
    parameter (the EMA weights in bfloat16) and each GPU's part in training 16 more (its resume state, gone
    when the stage ends). The node's disk at its fullest is the extracts, the sweep's and the comparison's
    complete parts and the resume states of one stage: within 64 GiB on one GPU and on eight, which on eight
    take at most a fifth of one GPU's time; with float32 weights and EMA (final+ema) it would not fit."""
    out = _estimate("--gpus", "1,8")
    one, eight = out.split("8 GPUs of one node")
    row = lambda block, name: next(x for x in block.splitlines() if x.startswith(name))
    model_disk = float(row(out.split("h_l read from")[1], "model (--states model)")[30:39])
    assert float(row(one, "extract")[30:39]) == model_disk
    n_train, tokens = int(20000 * 0.9), 282 * 64 * 127
    forward = 2 * n_train * 128 * 3 / 32 / 20000
    assert float(row(one, "train-bridge").split()[6]) == round((tokens / 14500 + forward) / 60)
    from tests.conftest import load_script

    den = load_script("estimate").denoiser_parameters(1024, 4096, 8)  # the paper bridge's, tested above
    for block, gpus in ((one, 1), (eight, 8)):
        sweep, compare = (float(row(block, name)[30:39]) for name in ("sweep", "compare"))
        assert sweep == pytest.approx((31 * den * 2 + gpus * den * 16) / 2**30, abs=0.05)
        assert compare == pytest.approx((54 * den * 2 + gpus * den * 16) / 2**30, abs=0.05)  # 9 x 3 x 2 parts
        peak = float(row(block, "peak")[30:39])
        outputs = 0.01 + 0.01 + 0.1 + 0.01  # the score's, fidelity's, the samples' and Gen.PPL's files
        assert peak == pytest.approx(model_disk + outputs + (85 * den * 2 + gpus * den * 16) / 2**30, abs=0.1)
        assert peak <= 64
    minutes = lambda block: float(row(block, "peak").split()[-1])
    assert minutes(eight) <= minutes(one) / 5
    wide = _estimate("--gpus", "8", "--keep-weights", "final+ema")
    assert float(row(wide, "peak")[30:39]) > 64


def _estimate(*args: str) -> str:
    """scripts/estimate.py's output for Llama-3.1-8B's shape."""
    import sys

    cmd = [sys.executable, "scripts/estimate.py", "--like", "llama-3.1-8b", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout

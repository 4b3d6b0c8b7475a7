"""The store's promise under faults (issue 45): same id, same bytes; nothing that looks complete is
incomplete; corruption is found before it is used. Each test reproduces one of the issue's findings
with a real kill -9, a real edit, a flipped byte or a full disk, and checks what a user sees."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dihal.artifacts import hidden_states as hs
from dihal.artifacts import store as store_mod
from dihal.artifacts.store import ArtifactStore
from tests.conftest import ROOT, TINY_BRIDGE, _extract, invoke, no_tmpfs, run_cli
from tests.test_hardening import _one_error_line


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dihal.cli", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _flip(path, offset: int = -1, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def _chunks(art, layer: int):
    return sorted(p for p in (art.path / "hidden.zarr" / "layers" / str(layer) / "c").rglob("*") if p.is_file())


def _verify_all(root) -> subprocess.CompletedProcess:
    return run_cli("runs", "verify", "--all", "--root", str(root))


# -- 1. a second identical command -------------------------------------------------------------------------
def _extract_arrays(art) -> dict:
    from tests import golden

    return golden.extract_view(art)


@pytest.mark.slow
def test_two_identical_commands_started_together_make_one_artifact_equal_to_a_lone_runs(tiny_dirs, tmp_path):
    """A real race (issue 63): the same extract started twice, the second 0 s and 0.5 s after the first (no
    load slowed: whichever takes the lock first writes), then once more with the second killed at a random point.
    Both exit 0 naming the same artifact, one wrote it and the other took it as a cache hit (after waiting on the
    lock, or after it was complete); exactly one artifact, complete and verified, its arrays equal to a lone
    run's, bit for bit. Before issue 45 the second reopened the first's complete artifact."""
    args = _extract(tiny_dirs, "--max-sequences", "48", "--batch-size", "4")
    lone = invoke(*args, "--root", str(tmp_path / "lone"))  # alone, in this process
    assert lone.exit_code == 0 and "done: extract" in lone.output, lone.output
    want = _extract_arrays(ArtifactStore(tmp_path / "lone").resolve("latest", "extract"))
    rng = random.Random(63)
    for trial, offset in enumerate((0.0, 0.5, "kill")):
        root = tmp_path / f"t{trial}"
        first = _cli(*args, "--root", str(root))
        time.sleep(rng.uniform(0.0, 1.0) if offset == "kill" else offset)
        second = _cli(*args, "--root", str(root))
        if offset == "kill":
            time.sleep(rng.uniform(0.5, 4.0))
            second.send_signal(signal.SIGKILL)
        outputs = [p.communicate(timeout=180) for p in (first, second)]
        codes = [p.returncode for p in (first, second)]
        (art,) = ArtifactStore(root).all("extract")
        assert art.complete, (offset, art.status, outputs)
        ends = [out.strip().splitlines()[-1] if out.strip() else "" for out, _ in outputs]
        if offset == "kill":
            assert codes[0] == 0 and codes[1] == -signal.SIGKILL, (codes, outputs)
            assert ends[0].startswith(("done: extract", "cache hit: extract")), outputs[0]
        else:
            assert codes == [0, 0], (offset, outputs)
            assert sorted(e.split(f" extract {art.id}")[0] for e in ends) == ["cache hit:", "done:"], (offset, ends)
            assert all(f"extract {art.id}" in e for e in ends), ends
            assert all("Traceback" not in err for _, err in outputs)
        verified = _verify_all(root)
        assert verified.returncode == 0 and "1 of 1 artifacts verified" in verified.stdout, verified.stdout
        got = _extract_arrays(art)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want), offset


# -- 2. a local dataset's content is in the id ---------------------------------------------------------------
def _corpus(path, words: str) -> None:
    path.write_text("\n\n".join(f"{words} paragraph {i} " + "text " * 20 for i in range(40)))


def test_an_edited_local_dataset_is_another_extract_not_a_cache_hit(tiny_dirs, root, tmp_path):
    corpus = tmp_path / "corpus.txt"
    _corpus(corpus, "alpha")
    args = _extract(tiny_dirs, "--dataset", str(corpus))
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    _corpus(corpus, "beta")
    os.utime(corpus, ns=(0, 0))  # even with the same mtime: the content decides
    second = invoke(*args)
    assert second.exit_code == 0 and "cache hit" not in second.output, second.output
    a, b = ArtifactStore(root).all("extract")
    assert a.id != b.id and a.config["data_sha256"] != b.config["data_sha256"]
    ids = [np.asarray(hs.open_group(x)["input_ids"][:]) for x in (a, b)]
    assert not np.array_equal(*ids)


def test_a_local_dataset_spelled_another_way_is_the_same_extract(tiny_dirs, root, tmp_path, monkeypatch):
    """The id reads the files, not the path as typed: ./x, d/../x and /abs/x are one extract (once, three
    spellings were three extracts of the same bytes, and evaluate's unseen-document check took them for
    three sources)."""
    corpus = tmp_path / "corpus.txt"
    _corpus(corpus, "alpha")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    spellings = [str(corpus), "../corpus.txt", f"{tmp_path}/sub/../corpus.txt"]
    outputs = [invoke(*_extract(tiny_dirs, "--dataset", spelled)) for spelled in spellings]
    assert all(r.exit_code == 0 for r in outputs), [r.output for r in outputs]
    assert ["cache hit" in r.output for r in outputs] == [False, True, True], [r.output for r in outputs]
    (art,) = ArtifactStore(root).all("extract")
    name = art.config["data"]["dataset"]
    assert name == f"corpus.txt@{art.config['data_sha256'][name][:12]}"  # its last part and its content
    assert art.manifest["data_paths"] == {name: str(corpus)}  # the path as first given, for the record


def test_an_extract_of_the_same_file_spelled_otherwise_at_another_seed_is_not_unseen(tiny_dirs, root, tmp_path):
    """evaluate.unseen: two extracts share a source when they read the same files, whatever the spelling; at
    another seed their splits differ, so one's validation documents are not unseen by the other."""
    from dihal.stages.evaluate import unseen

    corpus = tmp_path / "corpus.txt"
    _corpus(corpus, "alpha")
    for spelled, seed in ((str(corpus), "0"), (f"{tmp_path}/./corpus.txt", "1")):
        assert invoke(*_extract(tiny_dirs, "--dataset", spelled, "--seed", seed)).exit_code == 0
    a, b = ArtifactStore(root).all("extract")
    assert not unseen(a, b) and unseen(a, a)


def test_fidelity_on_an_edited_local_dataset_is_measured_anew_not_served_from_the_cache(tiny_dirs, root, tmp_path):
    """`dihal evaluate --bridge B --dataset FILE` hashed FILE's path alone: the README's own example (prose.txt
    made from the docs) served the old measurement after the docs changed. Now the file's content names it,
    and a path spelled another way is the same measurement."""
    from dihal.stages import train_bridge as bstage

    assert invoke(*_extract(tiny_dirs, "--layers", "0,2", "--seq-len", "12", "--max-sequences", "24")).exit_code == 0
    store = ArtifactStore(root)
    cfg = bstage.BridgeConfig.from_protocol("sweep-tiny", layer=2, steps=4, width=16, depth=1, batch_size=8)
    bridge = bstage.run(cfg, store.resolve("latest", "extract"), store)
    prose = tmp_path / "prose.txt"
    prose.write_text("\n\n".join(f"Zebra {i} quietly counts {i * 7} stones by the river." for i in range(60)))

    def evaluate(spelled: str):
        res = invoke("evaluate", "--bridge", bridge.id, "--dataset", spelled, "--limit", "4", "--sample-steps", "1")
        assert res.exit_code == 0, res.output
        return res.output, store.resolve("latest", "evaluate")

    _, first = evaluate(str(prose))
    said, again = evaluate(f"{tmp_path}/./prose.txt")
    assert "cache hit" in said and again.id == first.id, said
    prose.write_text("\n\n".join(f"A heron {i} waits for {i * 3} fish at dawn, then leaves." for i in range(60)))
    said, edited = evaluate(str(prose))
    assert "cache hit" not in said and edited.id != first.id, said
    kl = lambda art: art.manifest["metrics"]["fidelity"][0]["kl"]
    assert kl(edited) != kl(first)


def _perturb(model) -> None:
    """One block's weights moved, written over the model's own file (a fine-tuned checkpoint saved over)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = model / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if "layers.0.mlp" in k)
    tensors[name] = tensors[name] + 0.5 * torch.randn_like(tensors[name])
    save_file(tensors, weights, metadata={"format": "pt"})


def test_a_local_model_saved_over_at_the_same_path_is_another_extract(tiny_dirs, root, tmp_path):
    """A checkpoint written over the folder an extract read: the id hashed the path alone, so the extract of
    the old weights was served for the new ones (and every bridge after it trained on the old model's states
    under the new model's upper blocks)."""
    model = tmp_path / "checkpoint"
    shutil.copytree(tiny_dirs["llama"], model)
    args = [*_extract({"llama": model}), "--layers", "0,2"]
    assert invoke(*args).exit_code == 0
    _perturb(model)
    again = invoke(*args)
    assert again.exit_code == 0 and "cache hit" not in again.output, again.output
    old, new = sorted(ArtifactStore(root).all("extract"), key=lambda a: a.manifest["created"])
    assert old.config["model_sha256"] != new.config["model_sha256"]
    states = [hs.read_block(hs.open_group(a), 2, 0, 4) for a in (old, new)]
    assert not np.allclose(*states)
    assert "cache hit" in invoke(*args).output  # the same files: the same extract
    (model / "optimizer.pt").write_bytes(b"\0" * 64)  # a Trainer's state beside the model is not the model
    assert "cache hit" in invoke(*args).output


def test_a_bridge_whose_model_was_saved_over_is_refused_in_one_line(tiny_dirs, root, tmp_path):
    """The bridge was trained on the old model's states; run under the new model's upper blocks it would
    measure a model that never was: every stage that loads its backbone refuses, naming the fix."""
    from dihal.stages import train_bridge as bstage

    model = tmp_path / "checkpoint"
    shutil.copytree(tiny_dirs["llama"], model)
    assert (
        invoke(*_extract({"llama": model}, "--layers", "0,2", "--seq-len", "12", "--max-sequences", "24")).exit_code
        == 0
    )
    store = ArtifactStore(root)
    cfg = bstage.BridgeConfig.from_protocol("sweep-tiny", layer=2, steps=4, width=16, depth=1, batch_size=8)
    bridge = bstage.run(cfg, store.resolve("latest", "extract"), store)
    ok = invoke("evaluate", "--bridge", bridge.id, "--limit", "4", "--sample-steps", "1", "--device", "cpu")
    assert ok.exit_code == 0, ok.output
    _perturb(model)
    for args in (
        ["evaluate", "--bridge", bridge.id, "--limit", "4", "--sample-steps", "2"],
        ["generate", "--bridge", bridge.id, "--num-samples", "1", "--max-new-tokens", "2"],
    ):
        res = invoke(*args, "--device", "cpu")
        _one_error_line(res, "extract and train anew from the model as it is now", during_work=True)
        assert f"is not the one bridge {bridge.id} descends from" in res.output, res.output


def test_a_local_model_saved_over_is_another_generation_and_another_evaluators_score(tiny_dirs, root, tmp_path):
    """The same for a generation straight from a local model (no extract to hash it) and for samples scored
    under a local --evaluator: rewritten at the same path, each is measured anew."""
    model = tmp_path / "checkpoint"
    shutil.copytree(tiny_dirs["llama"], model)
    generate = ["generate", "--baseline", "original-only", "--model", str(model), "--num-samples", "2"]
    generate += ["--max-new-tokens", "4", "--device", "cpu"]
    store = ArtifactStore(root)

    def both() -> list[str]:
        outs = [invoke(*generate)]
        gen = sorted(store.all("generate"), key=lambda a: a.manifest["created"])[0]  # always score the first
        outs.append(invoke("evaluate", "--samples", gen.id, "--evaluator", str(model), "--device", "cpu"))
        assert all(r.exit_code == 0 for r in outs), [r.output for r in outs]
        return ["cache hit" in r.output for r in outs]

    assert both() == [False, False]
    assert both() == [True, True]
    _perturb(model)
    assert both() == [False, False]
    assert len(store.all("generate")) == 2 and len(store.all("evaluate")) == 2


def test_a_builtin_whose_package_holds_other_weights_is_another_extract(monkeypatch):
    """A builtin's ids stay while its package holds the GGUF they were made with; another one (an upgraded
    package) names other extracts instead of being served the old model's."""
    from dihal.stages import extract as ex
    from dihal.stages.configs import ExtractConfig
    from dihal.stages.lm import models

    cfg = ExtractConfig(model="smollm2-135m", layers="0,3")
    before = ex.artifact_id_for(cfg)
    assert "model_sha256" not in ex.resolved_config(cfg)
    monkeypatch.setitem(models.BUILTINS["smollm2-135m"], "sha256", "0" * 64)  # as if the package had moved
    assert ex.artifact_id_for(cfg) != before
    assert ex.resolved_config(cfg)["model_sha256"] == store_mod.file_sha256(models.builtin_gguf("smollm2-135m"))


def test_prompts_from_an_edited_local_file_are_another_generation(tiny_dirs, root, tmp_path):
    """generate --prompts-from FILE hashed the path alone: an edited file was served the old prompts' samples."""
    text = tmp_path / "prompts.txt"
    _corpus(text, "alpha")
    args = ["generate", "--baseline", "original-only", "--model", str(tiny_dirs["llama"]), "--prompts-from"]
    args += [str(text), "--prompt-tokens", "3", "--num-prompts", "2", "--num-samples", "1", "--max-new-tokens", "3"]
    first = invoke(*args, "--device", "cpu")
    assert first.exit_code == 0, first.output
    _corpus(text, "beta")
    second = invoke(*args, "--device", "cpu")
    assert second.exit_code == 0 and "cache hit" not in second.output, second.output
    a, b = sorted(ArtifactStore(root).all("generate"), key=lambda x: x.manifest["created"])
    prompts = [{json.loads(r)["prompt"] for r in x.file("samples.jsonl").read_text().splitlines()} for x in (a, b)]
    assert prompts[0] != prompts[1]


def test_a_file_digest_is_remembered_across_processes_until_any_write(tmp_path, monkeypatch):
    """stages/runtime/digests.py: an 8B model's weights are read once per change, not once per command; an
    edit that keeps the size and sets the mtime back (os.utime) is still read again (its ctime moved)."""
    import hashlib

    from dihal.stages.runtime import digests

    cache, f = tmp_path / "cache", tmp_path / "weights.bin"
    f.write_bytes(b"a" * 4096)
    os.utime(f, ns=(10**18, 10**18))
    monkeypatch.setattr(digests, "RACY_S", -1.0)  # as if written long ago (its ctime is now: utime moved it)
    first = digests.file_digest(f, cache)
    assert first == hashlib.sha256(b"a" * 4096).hexdigest() and (cache / digests.BOOK).is_file()
    reads = []
    monkeypatch.setattr(digests, "file_sha256", lambda p: reads.append(p) or store_mod.file_sha256(p))
    monkeypatch.setattr(digests, "_SEEN", {})  # another process: only the book remembers
    assert digests.file_digest(f, cache) == first and reads == []
    time.sleep(0.01)
    f.write_bytes(b"b" * 4096)  # the same size ...
    os.utime(f, ns=(10**18, 10**18))  # ... and the mtime set back
    monkeypatch.setattr(digests, "_SEEN", {})
    assert digests.file_digest(f, cache) == hashlib.sha256(b"b" * 4096).hexdigest() and reads == [f]
    (cache / digests.BOOK).write_text("{not json")  # a broken book is only a shortcut lost
    monkeypatch.setattr(digests, "_SEEN", {})
    assert digests.file_digest(f, cache) == hashlib.sha256(b"b" * 4096).hexdigest()
    monkeypatch.setattr(digests, "RACY_S", 2.0)
    fresh = tmp_path / "fresh.bin"
    fresh.write_bytes(b"c")  # written just now: read, not remembered (a second write this tick keeps its stamps)
    digests.file_digest(fresh, cache)
    assert str(fresh.resolve()) not in json.loads((cache / digests.BOOK).read_text())


@pytest.mark.slow
def test_an_edited_dataset_after_a_kill_is_extracted_anew_not_mixed(tiny_dirs, tmp_path):
    """Killed at chunk 2 of 6, the file edited, the same command rerun: once 'resuming: 2 of 6' mixed the
    old corpus with the new; now it is another id, extracted whole from the new file."""
    corpus = tmp_path / "corpus.txt"
    _corpus(corpus, "alpha")
    args = [*_extract(tiny_dirs, "--dataset", str(corpus), "--max-sequences", "24", "--batch-size", "4")]
    killed = run_cli(*args, "--root", str(tmp_path / "a"), kill_after=2)
    assert killed.returncode == -signal.SIGKILL
    _corpus(corpus, "beta")
    resumed = run_cli(*args, "--root", str(tmp_path / "a"))
    assert resumed.returncode == 0 and "resuming" not in resumed.stderr, resumed.stderr
    fresh = run_cli(*args, "--root", str(tmp_path / "b"), check=True)
    assert fresh.returncode == 0
    made = ArtifactStore(tmp_path / "a").resolve("latest", "extract")
    clean = ArtifactStore(tmp_path / "b").resolve("latest", "extract")
    assert made.id == clean.id
    for name in ("input_ids", "layers/2"):
        assert np.array_equal(hs.open_group(made)[name][:], hs.open_group(clean)[name][:])


def _fail_at_the_second_chunk(args, monkeypatch) -> None:
    """Run `args` (an extract) with its second chunk write failing as a full disk does: exit 2."""
    real_write, writes = hs.write_chunk, {"n": 0}

    def fail_second(*a, **k):
        writes["n"] += 1
        if writes["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_write(*a, **k)

    monkeypatch.setattr(hs, "write_chunk", fail_second)
    assert invoke(*args).exit_code == 2
    monkeypatch.setattr(hs, "write_chunk", real_write)


def test_a_resume_whose_packed_data_changed_is_refused(tiny_dirs, root, monkeypatch):
    """A source whose content the id cannot hash (a hub stream) changed between a failure and the resume:
    one line, and nothing mixed."""
    from dihal.stages import extract as ex
    from dihal.stages.text import data as data_mod

    args = _extract(tiny_dirs, "--max-sequences", "16", "--batch-size", "4")
    _fail_at_the_second_chunk(args, monkeypatch)
    real_pack = data_mod.pack

    def other_stream(*a, **k):
        packed = real_pack(*a, **k)
        packed.fingerprint = "f" * 64
        return packed

    monkeypatch.setattr(ex.data_mod, "pack", other_stream)
    _one_error_line(invoke(*args), "changed since it started", during_work=True)


# -- 3. code that changes results ------------------------------------------------------------------------------
def test_a_cache_hit_made_by_other_code_is_named_and_strict_cache_recomputes_it(chain, tiny_dirs, monkeypatch):
    store, ex, _ = chain
    args = _extract(tiny_dirs, "--layers", "0,2", "--max-sequences", "12", "--val-fraction", "0.25")
    assert ex.id in invoke(*args, "--dry-run").output
    ours = store_mod.code_identity()
    monkeypatch.setattr(store_mod, "code_identity", lambda: {**ours, "git_sha": "0123456789" * 4})
    hit = invoke(*args)
    assert hit.exit_code == 0 and "cache hit" in hit.output and "made by other code (git" in hit.output, hit.output
    strict = invoke("--strict-cache", *args)
    assert strict.exit_code == 0 and "cache hit" not in strict.output and "recomputing" in strict.output
    remade = ArtifactStore(store.root).load("extract", ex.id)
    assert remade.complete and remade.manifest["git_sha"] == "0123456789" * 4
    assert remade.manifest["finished"] != ex.manifest["finished"]
    again = invoke("--strict-cache", *args)
    assert "cache hit" in again.output and "other code" not in again.output  # made by this code now


# -- 4. corrupt payloads are never read ---------------------------------------------------------------------
BRIDGE_AGAIN = ["train-bridge", "--layer", "2", "--extract", "latest", *TINY_BRIDGE, "--train-steps", "5"]


def test_a_flipped_bit_in_a_zarr_chunk_stops_the_reader_with_one_line(chain):
    store, ex, _ = chain
    chunk = _chunks(ex, 2)[0]
    _flip(chunk, offset=len(chunk.read_bytes()) // 2)
    res = invoke(*BRIDGE_AGAIN)
    _one_error_line(res, "does not match the checksum recorded at completion", during_work=True)
    assert str(chunk) in res.output and "dihal runs verify" in res.output
    (failed,) = [a for a in ArtifactStore(store.root).all("bridge") if a.config["steps"] == 5]
    assert failed.status == "failed"


def test_a_deleted_zarr_chunk_is_an_error_never_zeros(chain):
    store, ex, _ = chain
    chunk = _chunks(ex, 2)[-1]
    chunk.unlink()
    res = invoke(*BRIDGE_AGAIN)
    _one_error_line(res, "is missing: a chunk recorded at completion, never read as zeros", during_work=True)


def test_a_flipped_exponent_bit_in_a_bridges_weights_stops_generate(chain):
    store, _, br = chain
    weights = br.path / "weights_ema.safetensors"
    _flip(weights, offset=-2, mask=0x40)  # an exponent bit of the last float32
    res = invoke("generate", "--bridge", br.id, "--num-samples", "2", "--max-new-tokens", "3", "--device", "cpu")
    _one_error_line(res, "weights_ema.safetensors does not match the checksum", during_work=True)
    assert [a.status for a in ArtifactStore(store.root).all("generate")] == ["failed"]


def _zarr_files(art, array: str):
    return sorted(p for p in (art.path / "hidden.zarr" / array / "c").rglob("*") if p.is_file())


def test_a_flipped_chunk_stops_every_reader_of_an_extract(chain, tiny_dirs):
    """score's pool, `evaluate --extract` and the Python API each read a complete artifact through its checksums:
    a flipped byte in what each reads is one line naming the file (only train-bridge was held to it)."""
    import dihal
    from dihal.artifacts.errors import DihalError

    store, ex, br = chain
    assert invoke(*_extract(tiny_dirs, "--layers", "0-3")).exit_code == 0
    scored = store.resolve("latest", "extract")
    pool = _zarr_files(scored, "sample/2")[0]
    _flip(pool, offset=len(pool.read_bytes()) // 2)
    score = ["score", "--extract", scored.id, "--tokens", "40", "--k", "4", "--device", "cpu"]
    res = invoke(*score)
    _one_error_line(res, "does not match the checksum recorded at completion", during_work=True)
    assert str(pool) in res.output
    _flip(pool, offset=len(pool.read_bytes()) // 2)  # mended: the score reads it now
    assert invoke(*score).exit_code == 0
    ids = _zarr_files(ex, "input_ids")[-1]  # fidelity reads the validation sequences' token ids
    _flip(ids, offset=len(ids.read_bytes()) // 2)
    res = invoke("evaluate", "--bridge", br.id, "--extract", ex.id, "--sample-steps", "2", "--device", "cpu")
    _one_error_line(res, "does not match the checksum recorded at completion", during_work=True)
    assert str(ids) in res.output
    score = store.resolve("latest", "score")
    table = score.path / "table.csv"
    _flip(table, offset=len(table.read_bytes()) // 2, mask=0x04)
    with pytest.raises(DihalError, match="table.csv does not match the checksum"):
        dihal.score_table(score.id, root=store.root)
    with pytest.raises(DihalError, match="table.csv does not match the checksum"):
        dihal.open_store(store.root).load(score.id).file("table.csv")
    weights = br.path / "weights_ema.safetensors"
    _flip(weights, offset=-2, mask=0x40)
    with pytest.raises(DihalError, match="weights_ema.safetensors does not match the checksum"):
        dihal.load_hybrid(br.id, root=store.root)


def test_a_file_edited_after_it_was_verified_with_its_mtime_put_back_is_read_again(chain):
    """A process verifies a file once per state of it; an edit that puts the mtime (and size) back is another
    state still (its ctime moved), so the next read in the same process hashes it again. Before: the state was
    (path, size, mtime), and the edited chunk and weights were served as verified."""
    import dihal
    from dihal.artifacts.errors import DihalError

    store, ex, br = chain
    args = ["evaluate", "--bridge", br.id, "--extract", ex.id, "--sample-steps", "2", "--device", "cpu"]
    assert invoke(*args).exit_code == 0  # every chunk it reads, verified in this process
    for path in (_zarr_files(ex, "input_ids")[-1], br.path / "weights_ema.safetensors"):
        st = path.stat()
        _flip(path, offset=len(path.read_bytes()) // 2, mask=0x10)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
        res = invoke(*args, "--force")
        _one_error_line(res, "recorded at completion (corrupt or edited)", during_work=True)
        assert f"{path} does not match the checksum" in res.output
        _flip(path, offset=len(path.read_bytes()) // 2, mask=0x10)
    with pytest.raises(DihalError, match="does not match the checksum"):  # the API in this process, too
        path = br.path / "stats.safetensors"
        dihal.load_hybrid(br.id, root=store.root)  # verified
        st = path.stat()
        _flip(path, offset=-1)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        dihal.load_hybrid(br.id, root=store.root)


# -- 5. corrupt headers and manifests --------------------------------------------------------------------------
def test_a_bad_safetensors_header_is_one_line_and_the_reader_failed(chain):
    store, _, br = chain
    stats = br.path / "stats.safetensors"
    stats.write_bytes(b"\xff" * 8 + stats.read_bytes()[8:])  # a header length past the file
    res = invoke("evaluate", "--bridge", br.id, "--sample-steps", "2", "--limit", "2", "--device", "cpu")
    _one_error_line(res, "stats.safetensors does not match the checksum", during_work=True)
    assert [a.status for a in ArtifactStore(store.root).all("evaluate")] == ["failed"]


def test_a_manifest_that_is_not_json_shows_as_corrupt_and_breaks_nothing_else(chain):
    store, ex, br = chain
    br.manifest_path.write_text(br.manifest_path.read_text()[:-40])
    listed = run_cli("runs", "list", "--root", str(store.root))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    assert next(line for line in listed.stdout.splitlines() if br.id in line).split()[2] == "corrupt"
    verified = _verify_all(store.root)
    assert verified.returncode == 1 and "Traceback" not in verified.stderr
    assert f"bridge/{br.id}: 1 problem(s): status is corrupt" in verified.stdout
    assert f"extract/{ex.id}: ok" in verified.stdout and "2 of 3 artifacts verified" in verified.stdout
    single = run_cli("runs", "verify", br.id, "--root", str(store.root))
    assert single.returncode == 1 and "manifest.json is unreadable" in single.stdout
    gen = invoke("generate", "--bridge", br.id, "--num-samples", "2", "--max-new-tokens", "3", "--device", "cpu")
    _one_error_line(gen, f"bridge/{br.id} is corrupt")
    rerun = invoke("train-bridge", "--layer", "2", "--extract", ex.id, *TINY_BRIDGE, "--train-steps", "4")
    _one_error_line(rerun, "rerun the command that made it with --force")
    forced = invoke("train-bridge", "--layer", "2", "--extract", ex.id, *TINY_BRIDGE, "--train-steps", "4", "--force")
    assert forced.exit_code == 0 and ArtifactStore(store.root).load("bridge", br.id).complete


def test_a_manifest_edited_to_other_valid_json_is_corrupt(chain):
    store, _, br = chain
    manifest = json.loads(br.manifest_path.read_text())
    manifest["config"]["width"] += 1  # the 64 -> 65
    br.manifest_path.write_text(json.dumps(manifest))
    res = run_cli("runs", "verify", br.id, "--root", str(store.root))
    assert res.returncode == 1 and "digest mismatch" in res.stdout, res.stdout
    manifest = json.loads(br.manifest_path.read_text())
    manifest["metrics"]["val_loss"] = 0.0
    manifest.pop("digest")  # no digest to compare with: the config still has to hash to the id
    manifest["config"]["width"] -= 1
    manifest["config"]["depth"] += 1
    br.manifest_path.write_text(json.dumps(manifest))
    res = run_cli("runs", "verify", br.id, "--root", str(store.root))
    assert res.returncode == 1 and "does not hash to its id" in res.stdout, res.stdout


# -- 6. a full disk ---------------------------------------------------------------------------------------------
def _used(path) -> int:
    """Bytes in use on the file system at path, as it counts them (whole pages)."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _mount(path, size: str, remount: bool = False) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    options = f"remount,size={size}" if remount else f"size={size}"
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0
    )


@pytest.mark.slow
def test_a_full_disk_is_one_line_failed_and_resumes_with_the_space_the_rest_needs(tiny_dirs, tmp_path):
    """extract on a disk that fills: one line, failed. With room for the rest (less than the whole estimate)
    the plain command resumes, where once only --force, which also deleted, got past the check. train-bridge
    on a full disk: one line and failed (was a SafetensorError traceback, left running), then resumes."""
    small = tmp_path / "small"
    args = [
        *_extract(tiny_dirs, "--max-sequences", "48", "--batch-size", "4", "--layers", "0,2"),
        "--root",
        str(small / "runs"),
    ]
    args += ["--store-dtype", "float32", "--val-fraction", "0.25"]
    plan = invoke(*args, "--dry-run").output
    estimate = float(plan.split("estimated size ")[1].split()[0]) * (1024 if "KiB" in plan else 1024**2)
    if not _mount(small, str(int(estimate * 0.75) + 96 * 1024)):  # a good part of it (and the 64 KiB reserve)
        no_tmpfs("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        res = invoke(*args, "--skip-disk-check")
        _one_error_line(res, "no space left on device", during_work=True)
        (art,) = ArtifactStore(small / "runs").all("extract")
        assert art.status == "failed"
        written = store_mod.dir_size(art.path)
        used = _used(small)
        # the rest with half again for tmpfs' 4 KiB pages, and 48 KiB for the manifests (written twice, atomically)
        room = used + int((estimate - written) * 1.5) + 48 * 1024
        assert room - used < estimate  # the whole estimate would not fit: only what is left does
        assert _mount(small, str(room), remount=True)
        resumed = invoke(*args)
        assert resumed.exit_code == 0 and "resuming" in resumed.output, resumed.output
        done = ArtifactStore(small / "runs").resolve("latest", "extract")
        assert _verify_all(small / "runs").returncode == 0
        assert _mount(small, str(_used(small) + 128 * 1024), remount=True)  # the manifests, not the weights
        train = ["train-bridge", "--layer", "2", "--extract", done.id, *TINY_BRIDGE, "--width", "64"]
        train += ["--train-steps", "10", "--root", str(small / "runs")]
        res = invoke(*train)
        _one_error_line(res, "no space left on device", during_work=True)
        (bridge,) = ArtifactStore(small / "runs").all("bridge")
        assert bridge.status == "failed"
        assert _mount(small, "64m", remount=True)
        again = invoke(*train)
        assert again.exit_code == 0 and ArtifactStore(small / "runs").load("bridge", bridge.id).complete
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


# -- 7. no traces of a kill -------------------------------------------------------------------------------------
def _bridge_args(root) -> list[str]:
    return [*BRIDGE_AGAIN[:-1], "10", "--root", str(root)]


@pytest.mark.slow
def test_kills_during_training_leave_each_step_once_and_the_last_kill_redoes_nothing(chain_store, tmp_path):
    """Killed before the first checkpoint, between checkpoints, and after the last step (the final state
    and weights written, the artifact not yet complete): metrics.jsonl has steps 1..N once each, in
    order; after the last kill no step is trained again; the weights equal an uninterrupted run's."""
    import shutil

    from dihal.artifacts import files

    reference = tmp_path / "reference"
    shutil.copytree(chain_store, reference)
    run_cli(*_bridge_args(reference), check=True)
    want = ArtifactStore(reference).resolve("latest", "bridge")
    for after in (1, 3, 10):
        root = tmp_path / f"k{after}"
        shutil.copytree(chain_store, root)
        killed = run_cli(*_bridge_args(root), kill_after=after)
        assert killed.returncode == -signal.SIGKILL
        resumed = run_cli(*_bridge_args(root), check=True)
        if after == 10:
            assert "resuming bridge L2 training at step 10 of 10" in resumed.stderr, resumed.stderr
        got = ArtifactStore(root).load("bridge", want.id)
        assert got.complete
        steps = [r["step"] for r in files.read_jsonl(got.file("metrics.jsonl"))]
        assert steps == list(range(1, 11)), (after, steps)
        for name in ("weights.safetensors", "weights_ema.safetensors"):
            a, b = files.load_tensors(got.file(name)), files.load_tensors(want.file(name))
            assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in b), (after, name)
        assert not (got.path / files.STATE_FILE).exists()
        assert _verify_all(root).returncode == 0


@pytest.mark.slow
def test_kill_9_at_random_points_of_generate_leaves_nothing_half_written(chain_store, tmp_path):
    import shutil

    rng = random.Random(7)
    gen = ["generate", "--bridge", "latest", "--num-samples", "6", "--max-new-tokens", "4", "--batch-size", "1"]
    gen += ["--device", "cpu"]  # one sample a batch: progress (and the kill) after each
    reference = tmp_path / "reference"
    shutil.copytree(chain_store, reference)
    run_cli(*gen, "--root", str(reference), check=True)
    want = ArtifactStore(reference).resolve("latest", "generate")
    for trial in range(2):
        root = tmp_path / f"g{trial}"
        shutil.copytree(chain_store, root)
        killed = run_cli(*gen, "--root", str(root), kill_after=rng.randint(1, 5))
        assert killed.returncode == -signal.SIGKILL
        assert ArtifactStore(root).all("generate")[0].status == "running"
        run_cli(*gen, "--root", str(root), check=True)
        got = ArtifactStore(root).load("generate", want.id)
        rows = lambda art: [
            json.loads(line)["token_ids"] for line in art.file("samples.jsonl").read_text().splitlines()
        ]
        assert got.complete and rows(got) == rows(want)
        assert _verify_all(root).returncode == 0


def test_cut_short_writes_are_never_recorded_and_are_cleaned_on_resume(tiny_dirs, root, monkeypatch):
    args = _extract(tiny_dirs, "--max-sequences", "16", "--batch-size", "4")
    _fail_at_the_second_chunk(args, monkeypatch)
    (art,) = ArtifactStore(root).all("extract")
    left = [art.path / "hidden.zarr" / "layers" / "2" / "c" / "0.0f3a.partial", art.path / "source.npy.tmp"]
    for path in left:  # what a kill inside Zarr's atomic write, or inside ours, leaves
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    assert invoke(*args).exit_code == 0
    done = ArtifactStore(root).load("extract", art.id)
    assert done.complete and not any(p.exists() for p in left)
    assert not [n for n in done.manifest["files"] if n.endswith((".partial", ".tmp"))]
    assert done.verify() == []


def test_a_folder_without_a_manifest_is_listed_and_collected(root):
    orphan = root / "bridge" / "0123456789ab"
    orphan.mkdir(parents=True)
    (orphan / "weights.safetensors").write_bytes(b"x")
    listed = run_cli("runs", "list", "--root", str(root))
    assert "0123456789ab" in listed.stdout and "no manifest" in listed.stdout, listed.stdout
    os.utime(orphan, (time.time() - 120, time.time() - 120))
    assert "0 artifact(s) removed" in run_cli("runs", "gc", "--older-than", "1h", "--root", str(root)).stdout
    gone = run_cli("runs", "gc", "--older-than", "1m", "--root", str(root))
    assert "removed bridge/0123456789ab (no manifest)" in gone.stdout and not orphan.exists()


def test_interrupted_conversions_are_removed_and_converted_weights_are_checked(tmp_path):
    from dihal.artifacts.errors import DihalError
    from dihal.stages.lm import models

    models_dir = tmp_path / "models"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = models_dir / f"abc.tmp{dead.pid}", models_dir / f"abd.tmp{os.getpid()}"
    for path in (stale, live):
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"0" * 100)
    models.clean_conversions(models_dir)
    assert not stale.exists() and live.exists()
    out = models_dir / "abc"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    digest = store_mod.file_sha256(out / "model.safetensors")
    (out / "dihal_source.json").write_text(json.dumps({"weights": {"model.safetensors": digest}}))
    models.check_conversion(out)
    (out / "model.safetensors").write_bytes(b"weighTs")
    with pytest.raises(DihalError, match=f"delete {out} and it is converted again"):
        models.check_conversion(out)


PARTS = {  # every trained part the one training loop runs, on the session chain's extract (layers 0 and 2)
    "prior": ["train-prior", "--extract", "latest", "--width", "16", "--depth", "1", "--heads", "2"],
    "decoder": ["train-decoder", "--extract", "latest", "--width", "16", "--heads", "2"],
    "autoencoder": ["train-autoencoder", "--extract", "latest", "--width", "16"],
}


@pytest.mark.slow
@pytest.mark.parametrize("part", sorted(PARTS))
def test_every_trained_part_resumes_a_kill_to_an_uninterrupted_runs_weights(part, chain_store, tmp_path):
    """The bridge's kill-and-resume (above) for the prior, the decoder and the autoencoder: killed between
    checkpoints, the same command resumes; each step is in metrics.jsonl once and the weights equal an
    uninterrupted run's."""
    import shutil

    from dihal.artifacts import files

    args = [*PARTS[part], "--batch-size", "4", "--train-steps", "10"]
    reference, root = tmp_path / "reference", tmp_path / "killed"
    shutil.copytree(chain_store, reference)
    shutil.copytree(chain_store, root)
    run_cli(*args, "--root", str(reference), check=True)
    want = ArtifactStore(reference).resolve("latest", part)
    killed = run_cli(*args, "--root", str(root), kill_after=5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run_cli(*args, "--root", str(root), check=True)
    assert "resuming" in resumed.stderr, resumed.stderr[-2000:]
    got = ArtifactStore(root).load(part, want.id)
    assert got.complete and [r["step"] for r in files.read_jsonl(got.file("metrics.jsonl"))] == list(range(1, 11))
    for name in ("weights.safetensors", "weights_ema.safetensors"):
        a, b = files.load_tensors(got.file(name)), files.load_tensors(want.file(name))
        assert set(a) == set(b) and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in b), name

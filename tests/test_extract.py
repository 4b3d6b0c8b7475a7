"""dihal extract: stored layers equal the reference forward; resume; errors; the builtin default."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from tests.conftest import _extract, invoke, run_cli


def _only_artifact(root, stage="extract"):
    arts = ArtifactStore(root).all(stage)
    assert len(arts) == 1, arts
    return arts[0]


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3"])
def test_stored_layers_equal_reference_forward(kind, tiny_dirs, root):
    from transformers import AutoModelForCausalLM

    res = invoke(
        "extract",
        "--model",
        str(tiny_dirs[kind]),
        "--max-sequences",
        "12",
        "--seq-len",
        "32",
        "--batch-size",
        "5",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    )
    assert res.exit_code == 0, res.output
    art = _only_artifact(root)
    group = hs.open_group(art)
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[kind]).eval()
    L = len(model.model.layers)
    assert hs.stored_layers(group) == list(range(L + 1))
    ids = torch.from_numpy(np.asarray(group["input_ids"][:]).astype(np.int64))
    assert ids.shape == (12, 32)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    for layer in range(L):
        stored = torch.from_numpy(np.asarray(group[f"layers/{layer}"][:]).astype(np.float32))
        torch.testing.assert_close(stored, ref[layer], atol=2e-3, rtol=2e-3)
    # layer L is the pre-norm output of the last block: the final norm of it is HF's last state
    last = torch.from_numpy(np.asarray(group[f"layers/{L}"][:]).astype(np.float32))
    assert not torch.allclose(last, ref[L], atol=1e-2)
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(last), ref[L], atol=5e-3, rtol=5e-3)
    if kind == "gemma3":  # layer 0 = token embeddings times sqrt(d)
        emb0 = model.model.embed_tokens.weight[ids] * (model.config.hidden_size**0.5)
        stored0 = torch.from_numpy(np.asarray(group["layers/0"][:]).astype(np.float32))
        torch.testing.assert_close(stored0, emb0, atol=5e-3, rtol=2e-3)
    manifest = art.manifest
    assert manifest["status"] == "complete" and manifest["model"]["num_blocks"] == L
    assert manifest["metrics"]["n_train"] + manifest["metrics"]["n_validation"] == 12
    assert np.asarray(group["attention_mask"][:]).all()
    assert (ids[:, 0] == 1).all(), "every sequence starts with BOS"


def test_layer_subset_stops_early_and_names_convention(tiny_dirs, root):
    res = invoke(
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--max-sequences",
        "4",
        "--seq-len",
        "16",
        "--layers",
        "0,2",
        "--device",
        "cpu",
    )
    assert res.exit_code == 0, res.output
    group = hs.open_group(_only_artifact(root))
    assert hs.stored_layers(group) == [0, 2]
    assert "before the final norm" in group.attrs["layer_convention"]


def test_rerun_is_cache_hit_and_force_recomputes(tiny_dirs, root):
    args = ("extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "4", "--seq-len", "16", "--device", "cpu")
    first = invoke(*args)
    assert first.exit_code == 0 and "done" in first.output
    second = invoke(*args)
    assert second.exit_code == 0 and "cache hit" in second.output
    forced = invoke(*args, "--force")
    assert forced.exit_code == 0 and "cache hit" not in forced.output


def _store_arrays(art):
    group = hs.open_group(art)
    names = [f"layers/{l}" for l in hs.stored_layers(group)] + ["input_ids", "attention_mask", "split", "committed"]
    return {name: np.asarray(group[name][:]) for name in names}


@pytest.mark.slow
def test_killed_extraction_resumes_to_identical_store(tiny_dirs, tmp_path):
    args = (
        "extract",
        "--model",
        str(tiny_dirs["gemma3"]),
        "--max-sequences",
        "24",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--device",
        "cpu",
    )
    killed = run_cli(*args, "--root", str(tmp_path / "a"), kill_after=2)
    assert killed.returncode == -signal.SIGKILL
    art = _only_artifact(tmp_path / "a")
    assert art.status == "running"
    assert hs.committed_chunks(hs.open_group(art)).sum() == 2
    resumed = run_cli(*args, "--root", str(tmp_path / "a"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 2 of 6 chunks" in resumed.stderr
    run_cli(*args, "--root", str(tmp_path / "b"), check=True)
    a, b = _store_arrays(_only_artifact(tmp_path / "a")), _store_arrays(_only_artifact(tmp_path / "b"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert _only_artifact(tmp_path / "a").complete


@pytest.mark.slow
def test_two_processes_shard_to_the_same_store(tiny_dirs, tmp_path):
    import subprocess
    import sys

    args = [
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--max-sequences",
        "20",
        "--seq-len",
        "16",
        "--batch-size",
        "3",
        "--device",
        "cpu",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "dihal.cli",
            *args,
            "--root",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_cli(*args, "--root", str(tmp_path / "single"), check=True)
    dist_art = _only_artifact(tmp_path / "dist")
    assert dist_art.manifest["world_size"] == 2 and dist_art.complete
    a, b = _store_arrays(dist_art), _store_arrays(_only_artifact(tmp_path / "single"))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-3, err_msg=name)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--layers", "0-99"], "out of range"),
        (["--seq-len", "100000"], "exceeds the model's context"),
        (["--dataset", "missing/file.jsonl"], "does not exist"),
        (["--dataset", str(Path(__file__).resolve().parent)], "is a folder; give its files, e.g."),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle, tiny_dirs, root):
    base = ["extract", "--max-sequences", "4", "--seq-len", "16", "--device", "cpu"]
    if "--model" not in args:
        base += ["--model", str(tiny_dirs["llama"])]
    res = invoke(*base, *args)
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_missing_text_field_is_one_line(tiny_dirs, root, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"body": "some words here " * 20}) for _ in range(5)))
    res = invoke(
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--dataset",
        str(data),
        "--max-sequences",
        "2",
        "--seq-len",
        "16",
        "--device",
        "cpu",
    )
    assert res.exit_code == 2 and "no text field 'text'" in res.output and "--text-field" in res.output
    ok = invoke(
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--dataset",
        str(data),
        "--text-field",
        "body",
        "--max-sequences",
        "2",
        "--val-fraction",
        "0",
        "--seq-len",
        "16",
        "--device",
        "cpu",
    )
    assert ok.exit_code == 0, ok.output


def test_hub_id_offline_fails_fast_with_builtins_named(root, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = invoke("extract", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--max-sequences", "2", "--device", "cpu")
    assert res.exit_code == 2
    assert "smollm2-135m" in res.output and "HF_HUB_OFFLINE" in res.output


def test_dry_run_validates_without_writing(tiny_dirs, root):
    res = invoke(*_extract(tiny_dirs, "--layers", "0-2", "--dry-run"))
    assert res.exit_code == 0 and "estimated size" in res.output
    assert not root.exists() or not any(root.rglob("manifest.json"))


@pytest.mark.slow
def test_builtin_smollm2_all_layers_and_cache_hit(root):
    args = (
        "extract",
        "--model",
        "smollm2-135m",
        "--dataset",
        "pydoc",
        "--layers",
        "all",
        "--max-sequences",
        "32",
        "--seq-len",
        "64",
        "--device",
        "cpu",
    )
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    group = hs.open_group(_only_artifact(root))
    assert hs.stored_layers(group) == list(range(31))
    for layer in range(31):
        assert group[f"layers/{layer}"].shape == (32, 64, 576)
    assert set(np.asarray(group["split"][:]).tolist()) == {0, 1}
    second = invoke(*args)
    assert second.exit_code == 0 and "cache hit" in second.output


def test_float16_overflow_is_detected_with_the_fix_named(tmp_path, root):
    from tests.conftest import build_tiny

    model, tok = build_tiny("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1e8)  # layer-0 states far beyond float16's 65504
    model.save_pretrained(tmp_path / "huge")
    tok.save_pretrained(tmp_path / "huge")
    args = ("extract", "--model", str(tmp_path / "huge"), "--max-sequences", "4", "--seq-len", "16", "--device", "cpu")
    res = invoke(*args, "--store-dtype", "float16")
    assert res.exit_code == 2 and "beyond float16's range" in res.output and "--store-dtype float32" in res.output
    assert _only_artifact(root).status == "failed"
    auto = invoke(*args)  # the default, auto: float16 divided by a power of two where the values need it
    assert auto.exit_code == 0, auto.output
    art = [a for a in ArtifactStore(root).all("extract") if a.complete][0]
    assert art.manifest["metrics"]["store_dtypes"]["0"] == "float16"
    scale = art.manifest["metrics"]["store_scales"]["0"]
    assert scale == 2.0 ** round(np.log2(scale)) and scale > 1
    group = hs.open_group(art)
    assert str(group["layers/0"].dtype) == "float16" and group["layers/0"].attrs["scale"] == scale
    ids = torch.from_numpy(np.asarray(group["input_ids"][:]).astype(np.int64))
    with torch.no_grad():  # an independent forward; the embeddings are layer 0
        reference = model.model.embed_tokens(ids).float().numpy()
    stored = hs.read_sequences(group, 0, np.arange(ids.shape[0]))
    assert np.abs(stored).max() > 65504 and np.isfinite(stored).all()
    np.testing.assert_allclose(stored, reference, rtol=2.0**-11)  # float16's precision, at any scale
    seqs, positions, pool = hs.read_pool(group, 0)  # the score's pool reads back in the same units
    np.testing.assert_allclose(pool, reference[seqs, positions], rtol=2.0**-11)


def test_auto_store_dtype_rule():
    from dihal.stages.extract import AUTO_HEADROOM, FLOAT16_MAX, check_float16, choose_storage

    fits, near, over = (  # (batch, positions, width)
        torch.full((2, 4, 3), 100.0),
        torch.full((2, 4, 3), FLOAT16_MAX / AUTO_HEADROOM * 1.01),
        torch.full((1, 4, 3), 7e4),
    )
    sink = fits.clone()
    sink[:, 0] = 1e6  # only the start token's state is huge: it is kept apart, so the layer fits float16
    broken = torch.full((1, 4, 3), float("inf"))
    dtypes, scales = choose_storage({0: fits, 1: near, 2: over, 3: sink, 4: broken}, "auto")
    assert dtypes == {0: "float16", 1: "float16", 2: "float16", 3: "float16", 4: "float32"}
    # the smallest power of two that brings 4x the peak under 65504: 1, 2 (1.01 x the limit), 8 (7e4 x 4)
    assert scales == {0: 1.0, 1: 2.0, 2: 8.0, 3: 1.0, 4: 1.0}
    assert choose_storage({0: over}, "float16") == ({0: "float16"}, {0: 1.0})
    with pytest.raises(Exception, match="auto chose float16 from the first batch"):
        check_float16(3, over, "auto")


def test_disk_estimate_refuses_when_space_is_short(tiny_dirs, root, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    args = ["extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "8", "--seq-len", "16", "--device", "cpu"]
    res = invoke(*args)
    assert res.exit_code == 2 and "MiB free" in res.output and "--skip-disk-check" in res.output
    assert invoke(*args, "--force").exit_code == 2  # --force recomputes; it does not skip the check
    assert invoke(*args, "--skip-disk-check").exit_code == 0


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """A tiny llama whose block 2 writes values past float16's 65504 (as gemma3-270m's layers 8-18 do)."""
    from tests.conftest import build_tiny

    model, tok = build_tiny("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e6)
    path = tmp_path_factory.mktemp("tiny-overflow")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_float16_overflow_stops_with_the_layer_and_the_dtype_to_use(overflowing, root):
    base = ["--model", str(overflowing), "--max-sequences", "8", "--seq-len", "16", "--device", "cpu"]
    res = invoke("extract", *base, "--dtype", "float16")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.output.strip().splitlines()[-1] == (
        f"error: layer 2 of {overflowing.name} is not finite in float16 (its states pass float16's range of "
        "65504); rerun with --dtype bfloat16 or float32"
    )
    (failed,) = ArtifactStore(root).all("extract")
    assert failed.status == "failed" and "layer 2" in failed.manifest["error"]
    zarr_dir = failed.path / "hidden.zarr"
    assert not zarr_dir.exists() or not hs.committed_chunks(hs.open_group(failed)).any()
    # any stage that reads the model in float16 says the same, here the backbone's own samples
    res = invoke(
        "generate",
        "--baseline",
        "original-only",
        "--model",
        str(overflowing),
        "--num-samples",
        "2",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
        "--dtype",
        "float16",
    )
    assert res.exit_code == 2 and "layer 2 of" in res.output and "--dtype bfloat16 or float32" in res.output
    assert invoke("extract", *base, "--dtype", "float32").exit_code == 0  # the cure it names works


def test_an_extract_that_stored_non_finite_states_is_refused_by_training(tmp_path):
    from dihal.artifacts.errors import DihalError
    from dihal.stages.diffusion.normalizer import Normalizer

    group = hs.create(tmp_path / "h.zarr", [0, 3], 4, 5, 2, {0: "float32", 3: "float32"}, 2, {})
    group["layers/0"][:] = 1.0
    group["layers/3"][:] = np.nan  # what a float16 extract of gemma3-270m stored at layer 12 before the check
    with pytest.raises(DihalError, match="layer 3 of this extract holds non-finite states"):
        Normalizer.fit(group, 0, 3, np.arange(4))

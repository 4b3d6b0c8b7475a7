"""Bad input gets one `error:` line and exit 2; faults leave completed work intact; piped logs show
progress; tables fit 80 columns; every stage says when it reused an artifact."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess

import pytest

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from tests.conftest import TINY_BRIDGE, _extract, invoke, no_tmpfs, run_cli


def _one_error_line(res, needle: str, during_work: bool = False) -> None:
    """Exit 2 and one `error:` line naming the problem; nothing else, unless the failure came during
    work, when the progress lines printed before it may stand above it."""
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], res.output
    assert during_work or len(lines) == 1, res.output
    assert needle in errors[0], res.output
    assert "Traceback" not in res.output


BAD_FILES = {
    "empty.txt": (b"", "is empty"),
    "number.jsonl": (b'{"text": "fine words"}\n{"text": 5}\n', "record 1 of dataset"),
    "broken.jsonl": (b'{"text": "a"\n', "cannot read dataset"),
    "latin1.txt": ("caf\u00e9 cr\u00e8me\n".encode("latin-1"), "is not UTF-8 text"),
    "blank.jsonl": (b'{"text": ""}\n{"text": "   "}\n', "holds no non-empty text"),
    "missing.jsonl": (b'{"text": "words"}\n{"body": "other"}\n', "has no field 'text'"),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
@pytest.mark.parametrize("dry_run", [False, True])
def test_bad_local_data_is_one_line_before_any_work(name, dry_run, tiny_dirs, root, tmp_path):
    content, needle = BAD_FILES[name]
    (tmp_path / name).write_bytes(content)
    res = invoke(*_extract(tiny_dirs, "--dataset", str(tmp_path / name), *(["--dry-run"] if dry_run else [])))
    _one_error_line(res, needle)
    assert not any(root.rglob("manifest.json")) if root.exists() else True  # refused before an artifact began


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--store-dtype", "int8"], "would not keep the states"),
        (["--seq-len", "0"], "--seq-len must be at least 2"),
        (["--layers", "5-2"], "range 5-2 is reversed; write 2-5"),
        (["--layers", "0,x"], "cannot read --layers"),
        (["--val-fraction", "1.5"], "--val-fraction must be in [0, 1)"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--max-sequences", "0"], "--max-sequences must be at least 1"),
    ],
)
def test_extract_flags_are_validated_alike_in_dry_and_real_runs(args, needle, tiny_dirs, root):
    real = invoke(*_extract(tiny_dirs, *args))
    dry = invoke(*_extract(tiny_dirs, *args, "--dry-run"))
    _one_error_line(real, needle)
    assert dry.output == real.output and dry.exit_code == 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train-bridge", "--layer", "2", "--train-steps", "0"], "--train-steps must be at least 1"),
        (["train-bridge", "--layer", "2", "--width", "30", "--heads", "4"], "must be divisible by --heads"),
        (["train-bridge", "--layer", "0"], "--layer must be at least 1"),
        (["train-bridge", "--layer", "2", "--ema", "1.5"], "--ema must be in [0, 1)"),
        (["score", "--tokens", "2"], "--tokens must be at least 3"),
        (["score", "--exclude-positions", "a"], "cannot read --exclude-positions"),
        (["evaluate", "--bridge", "x", "--sample-steps", "a"], "cannot read --sample-steps"),
        (["generate", "--sample-steps", "0"], "--sample-steps must be at least 1"),
        (["generate", "--temperature", "-1"], "--temperature must be >= 0"),
        (["sweep", "--layers", "3-1"], "range 3-1 is reversed"),
        (["runs", "gc", "--older-than", "soon"], "cannot read --older-than"),
    ],
)
def test_numeric_flags_of_every_stage(args, needle, root):
    _one_error_line(invoke(*args), needle)
    if args[0] not in ("runs",):
        _one_error_line(invoke(*args, "--dry-run"), needle)


def test_empty_store_names_the_command_to_run(root):
    _one_error_line(invoke("generate", "--bridge", "latest"), "run `dihal train-bridge` first")


def test_every_stage_reports_a_cache_hit(chain, tiny_dirs):
    store, ex, br = chain
    commands = [
        _extract(tiny_dirs, "--layers", "0,2", "--max-sequences", "12", "--val-fraction", "0.25"),
        ["score", "--extract", ex.id, "--tokens", "40", "--k", "4", "--candidates", "1,2", "--pairs", "50"],
        ["train-bridge", "--layer", "2", "--extract", ex.id, *TINY_BRIDGE, "--train-steps", "4"],
        ["evaluate", "--bridge", br.id, "--sample-steps", "2", "--limit", "2", "--device", "cpu"],
        ["generate", "--bridge", br.id, "--num-samples", "2", "--max-new-tokens", "4", "--device", "cpu"],
    ]
    ex_layers = [
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--max-sequences",
        "12",
        "--seq-len",
        "16",
        "--val-fraction",
        "0.25",
        "--layers",
        "0-2",
        "--device",
        "cpu",
    ]
    assert invoke(*ex_layers).exit_code == 0
    commands[1][2] = store.resolve("latest", "extract").id
    for args in commands:
        first = invoke(*args)
        assert first.exit_code == 0, (args, first.output)
        second = invoke(*args)
        assert second.exit_code == 0 and "cache hit" in second.output, (args, second.output)
    gen = store.resolve("latest", "generate").id
    for _ in range(2):
        last = invoke("evaluate", "--samples", gen, "--device", "cpu")
        assert last.exit_code == 0, last.output
    assert "cache hit" in last.output


def test_verify_names_missing_truncated_and_flipped_files(chain):
    store, ex, br = chain
    ok = invoke("runs", "verify", "--all")
    assert ok.exit_code == 0 and "3 of 3 artifacts verified" in ok.output, ok.output  # with the bridge's moments
    chunk = sorted((ex.path / "hidden.zarr" / "layers" / "2" / "c").rglob("*"))[-1]
    chunk.unlink()
    weights = br.file("weights_ema.safetensors")
    weights.write_bytes(weights.read_bytes()[:-10])
    stats = br.file("stats.safetensors")
    data = bytearray(stats.read_bytes())
    data[-1] ^= 0xFF
    stats.write_bytes(bytes(data))
    res = invoke("runs", "verify", "--all")
    assert res.exit_code == 1, res.output
    rel = str(chunk.relative_to(ex.path))
    assert f"missing {rel}" in res.output and "altered weights_ema.safetensors" in res.output
    assert "altered stats.safetensors" in res.output and "1 of 3 artifacts verified" in res.output  # the moments
    single = invoke("runs", "verify", br.id)
    assert single.exit_code == 1 and "weights_ema.safetensors" in single.output


def test_rm_refuses_parents_unless_recursive_and_gc_takes_only_old_failures(chain):
    store, ex, br = chain
    _one_error_line(invoke("runs", "rm", ex.id), "has 2 children")  # the bridge and its layer's moments
    assert ex.path.exists()
    failed = store.begin("score", {"old": True}, {"extract": ex.id})
    failed.fail("boom")
    failed.manifest["created"] = "2020-01-01T00:00:00.000000+00:00"
    failed.save_manifest()
    fresh_failed = store.begin("score", {"new": True}, {"extract": ex.id})
    fresh_failed.fail("boom")
    listed = invoke("runs", "gc", "--older-than", "1d", "--dry-run")
    assert listed.exit_code == 0 and f"would remove score/{failed.id}" in listed.output
    assert fresh_failed.id not in listed.output and failed.path.exists()
    gone = invoke("runs", "gc", "--older-than", "1d")
    assert gone.exit_code == 0 and not failed.path.exists() and fresh_failed.path.exists() and br.path.exists()
    res = invoke("runs", "rm", ex.id, "--recursive")
    assert res.exit_code == 0 and not ex.path.exists() and not br.path.exists(), res.output


# -- faults ---------------------------------------------------------------------------------------------
def test_out_of_disk_marks_failed_keeps_others_and_resumes(tiny_dirs, root, monkeypatch):
    args = _extract(tiny_dirs, "--max-sequences", "16", "--batch-size", "4", "--layers", "0-4")
    assert invoke(*_extract(tiny_dirs, "--layers", "0,1")).exit_code == 0
    kept = ArtifactStore(root).resolve("latest", "extract")
    real_write, calls = hs.write_chunk, {"n": 0}

    def full_disk(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*a, **kw)

    monkeypatch.setattr(hs, "write_chunk", full_disk)
    res = invoke(*args)
    _one_error_line(res, "no space left on device", during_work=True)
    failed = [a for a in ArtifactStore(root).all("extract") if a.id != kept.id][0]
    assert failed.status == "failed" and "no space left" in failed.manifest["error"]
    assert kept.verify() == []
    monkeypatch.setattr(hs, "write_chunk", real_write)
    again = invoke(*args)
    assert again.exit_code == 0 and "resuming: 1 of 4 chunks" in again.output, again.output


def test_out_of_gpu_memory_is_one_line_and_marks_the_artifact_failed(tiny_dirs, root, monkeypatch):
    """A CUDA OOM is bad input like any other: one line naming the batch flags, exit 2, the artifact
    `failed` (not left `running`), and the same command resumes once it fits."""
    import torch

    from dihal.stages import train_bridge as bridge

    assert (
        invoke(*_extract(tiny_dirs, "--max-sequences", "16", "--layers", "0,2", "--val-fraction", "0.25")).exit_code
        == 0
    )
    real_loss = bridge.BridgeTask.loss

    def too_big(self, *args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(bridge.BridgeTask, "loss", too_big)
    train = [
        "train-bridge",
        "--layer",
        "2",
        "--extract",
        "latest",
        "--protocol",
        "sweep-tiny",
        "--width",
        "16",
        "--depth",
        "1",
        "--heads",
        "2",
        "--batch-size",
        "4",
        "--train-steps",
        "3",
        "--device",
        "cpu",
    ]
    res = invoke(*train)
    _one_error_line(res, "out of GPU memory in train-bridge at batch 4; lower --train-batch / --batch-size", True)
    (failed,) = ArtifactStore(root).all("bridge")
    assert failed.status == "failed" and "out of GPU memory" in failed.manifest["error"]
    monkeypatch.setattr(bridge.BridgeTask, "loss", real_loss)
    assert invoke(*train).exit_code == 0 and ArtifactStore(root).resolve("latest", "bridge").complete
    # a model that does not fit, loaded under the artifact's lock: the same rule, that artifact failed
    from dihal.stages.lm import models

    monkeypatch.setattr(models, "_from_pretrained", lambda *a, **k: too_big(None))
    res = invoke(*_extract(tiny_dirs, "--max-sequences", "12"))
    _one_error_line(res, "out of GPU memory in extract at batch 8; lower --train-batch / --batch-size", True)
    assert [a.status for a in ArtifactStore(root).all("extract")].count("failed") == 1


def _mount_tmpfs(path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0
    )


def test_real_full_disk_and_read_only_root(tiny_dirs, tmp_path):
    small, ro = tmp_path / "small", tmp_path / "ro"
    if not _mount_tmpfs(small, "size=160k"):
        no_tmpfs("mounting a tmpfs needs root")
    try:
        res = invoke(
            *_extract(tiny_dirs, "--max-sequences", "64", "--store-dtype", "float32", "--skip-disk-check"),
            "--root",
            str(small),
        )
        _one_error_line(res, "no space left on device", during_work=True)
        assert ArtifactStore(small).all("extract")[0].status == "failed"  # was also "running", the bug issue 45 fixed
        assert _mount_tmpfs(ro, "ro,size=64k")
        res = invoke(*_extract(tiny_dirs, "--root", str(ro / "runs")))
        _one_error_line(res, "read-only file system")
        assert "choose a writable --root" in res.output
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_root_under_a_file_is_one_line(tiny_dirs, tmp_path):
    (tmp_path / "afile").write_text("x")
    _one_error_line(
        invoke(*_extract(tiny_dirs, "--root", str(tmp_path / "afile" / "runs"))), "choose a writable --root"
    )


def test_a_second_identical_extract_waits_for_the_first_then_takes_its_lock(tiny_dirs, root):
    """The lock is taken before the cache is checked again: a second identical command waits (and says so)
    while another process holds the artifact's lock, then goes on once it is free."""
    import threading

    args = _extract(tiny_dirs)
    plan_id = invoke(*args, "--dry-run").output.split("artifact extract/")[1].split()[0]
    held, release = threading.Event(), threading.Event()

    def holder():  # as if another process were extracting it for a moment
        with ArtifactStore(root).lock("extract", plan_id):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    threading.Timer(1.0, release.set).start()
    res = invoke(*args)
    thread.join()
    assert res.exit_code == 0 and "another process is writing" in res.output and "waiting" in res.output, res.output
    assert ArtifactStore(root).load("extract", plan_id).complete


# -- what a piped log and an 80-column terminal show ------------------------------------------------------
@pytest.mark.slow
def test_piped_training_prints_plain_progress_lines(tiny_dirs, root):
    assert (
        invoke(*_extract(tiny_dirs, "--layers", "0,2", "--max-sequences", "12", "--val-fraction", "0.25")).exit_code
        == 0
    )
    res = invoke(
        "--log-every", "0", "train-bridge", "--layer", "2", "--extract", "latest", *TINY_BRIDGE, "--train-steps", "5"
    )
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("bridge L2: ")]
    assert lines[0] == "bridge L2: warmup 15 is more than a tenth of a run of 5 steps; using 0"
    assert lines[2] == "bridge L2: started, 5 steps to do"
    assert any(line.startswith("bridge L2: 3/5 steps (60%), loss ") and "ETA" in line for line in lines), lines
    assert lines[-1].startswith("bridge L2: 5/5 steps (100%)") and lines[-1].endswith("(finished)")


def test_threads_set_torch_and_are_recorded_in_the_manifest(tiny_dirs, root, monkeypatch):
    """--threads N is what OMP_NUM_THREADS=N did for two jobs on two cores; the count a stage ran with is in its
    manifest, since sampled tokens can differ with it."""
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert invoke("--threads", "1", *_extract(tiny_dirs)).exit_code == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert ArtifactStore(root).resolve("latest", "extract").manifest["environment"]["threads"] == 1
    for value in ("0", "-2", "two"):
        _one_error_line(invoke("--threads", value, "runs", "list"), "--threads")


@pytest.mark.parametrize(
    "unit,count,shown",
    [("step", 2000, "steps"), ("step", 1, "step"), ("layer x draw", 6, "layer x draws"), ("tok", 9, "tok")],
)
def test_progress_counts_read_as_english(unit, count, shown):
    from dihal.cli.ui import plural

    assert plural(unit, count) == shown


@pytest.mark.slow
def test_tables_fit_80_columns_with_whole_numbers(tiny_dirs, root):
    assert invoke(*_extract(tiny_dirs, "--max-sequences", "12")).exit_code == 0
    res = run_cli("score", "--tokens", "60", "--k", "5", "--pairs", "100", env={"COLUMNS": "80"})
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if not line.startswith("done: ")]  # a path may be long
    assert max(len(line) for line in lines) <= 80, res.stdout
    rows = [line.split() for line in lines if line.strip()[:1].isdigit()]
    assert len(rows) == 3  # candidates 1..L-1 of a 4-block model
    for row in rows:
        assert len(row) == 9, row
        for cell in row:
            float(cell)  # every cell a whole number, none split across lines


def test_number_format_is_4_significant_digits():
    from dihal.cli.ui import fmt

    assert [fmt(v) for v in (0.005359, 5.359e-5, 123456.7, 42.0, 3, 0.0)] == [
        "0.005359",
        "5.359e-5",
        "1.235e5",
        "42",
        "3",
        "0",
    ]


# -- security: nothing runs from the store or a model directory unless asked ---------------------------------
def test_pickled_resume_state_is_refused_and_never_run(chain, tmp_path):
    store, ex, br = chain
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    import pickle

    (br.path / "state.pt").write_bytes(pickle.dumps({"step": 2, "x": Payload()}))
    br.manifest["status"] = "running"  # as an interrupted run would have left it
    br.save_manifest()
    res = invoke("train-bridge", "--layer", "2", "--extract", ex.id, *TINY_BRIDGE, "--train-steps", "4")
    _one_error_line(res, "is a pickled checkpoint, which dihal never loads", during_work=True)
    assert not marker.exists()
    (br.path / "state.pt").unlink()
    (br.path / "state.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    res = invoke("train-bridge", "--layer", "2", "--extract", ex.id, *TINY_BRIDGE, "--train-steps", "4")
    _one_error_line(res, "is unreadable", during_work=True)


def test_resume_state_round_trips_plain_types_and_tensors(tmp_path):
    import torch

    from dihal.artifacts import files

    state = {
        "step": 7,
        "log": [{"loss": 0.5}],
        "optimizer": {
            "state": {0: {"exp_avg": torch.ones(3)}},
            "param_groups": [{"betas": (0.9, 0.99), "params": [0]}],
        },
        "ema": {"w": torch.arange(4.0)},
    }
    files.save_state(tmp_path, state)
    back = files.load_state(tmp_path)
    assert back["step"] == 7 and back["log"] == [{"loss": 0.5}]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], torch.ones(3))
    assert torch.equal(back["ema"]["w"], torch.arange(4.0))
    with pytest.raises(TypeError):
        files.save_state(tmp_path, {"bad": object()})


CUSTOM_CODE = """
import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("custom code ran")
from transformers import LlamaConfig, LlamaForCausalLM


class CustomConfig(LlamaConfig):
    model_type = "custom-llama"


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


@pytest.mark.slow
def test_model_code_runs_only_with_trust_remote_code(tiny_dirs, tmp_path):

    model_dir = tmp_path / "custom"
    shutil.copytree(tiny_dirs["llama"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        model_type="custom-llama",
        architectures=["CustomForCausalLM"],
        auto_map={
            "AutoConfig": "modeling_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
        },
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "modeling_custom.py").write_text(CUSTOM_CODE)
    env = {"HF_HOME": str(tmp_path / "hf"), "DIHAL_ROOT": str(tmp_path / "runs")}
    args = ["extract", "--model", str(model_dir), "--max-sequences", "4", "--seq-len", "16", "--device", "cpu"]
    for extra in ([], ["--dry-run"]):
        refused = run_cli(*args, *extra, env=env)
        assert (
            refused.returncode == 2
            and refused.stderr.startswith("error: model")
            and "--trust-remote-code" in refused.stderr
        )
        assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
        assert not any(tmp_path.rglob("RAN")), "custom code ran without --trust-remote-code"
    trusted = run_cli(*args, "--trust-remote-code", env=env)
    assert trusted.returncode == 0, trusted.stderr
    assert trusted.stderr.count("warning: --trust-remote-code") >= 1
    assert any(tmp_path.rglob("RAN"))
    art = ArtifactStore(tmp_path / "runs").resolve("latest", "extract")
    assert art.config["trust_remote_code"] is True and art.manifest["model"]["trust_remote_code"] is True


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["train-bridge", "--layer", "1", "--max-sequences", "1"],
            "error: the bridge's validation loss: --max-sequences 1 at --val-fraction 0.1 holds 0 held-out sequences "
            "and 1 are needed; raise --max-sequences or --val-fraction",
        ),
        (
            ["sweep", "--layers", "1,2", "--max-sequences", "8", "--seq-len", "16"],
            "error: --tokens 4096 asked for, but --max-sequences 8 gives at most 105 train positions; lower --tokens "
            "or extract more sequences",
        ),
        (
            ["compare", "--max-sequences", "40", "--evaluator", "smollm2-135m"],
            "error: the comparison: --max-sequences 40 at --val-fraction 0.1 holds 4 held-out sequences and 256 are "
            "needed; raise --max-sequences or --val-fraction (or lower --num-samples, or --controls '')",
        ),
    ],
)
def test_sizes_known_from_the_plan_fail_before_any_model_loads(args, says, tiny_dirs, root, no_model_loads):
    """Each of these used to fail after its extract had run (and, for the comparison, its score)."""
    for extra in ([], ["--dry-run"]):
        res = invoke(*args, "--model", str(tiny_dirs["llama"]), "--device", "cpu", *extra)
        _one_error_line(res, says.removeprefix("error: "))


def test_an_error_line_prints_brackets_as_typed(root):
    """rich read '[bold]' in a user's value (and '[eval]' in an install command) as markup and dropped it,
    so the line named a value the user never gave."""
    res = invoke("train-bridge", "--layer", "1", "--protocol", "[bold]x", "--dry-run")
    _one_error_line(res, "unknown --protocol '[bold]x'; use one of")

"""--report-to (stages/runtime/trackers.py): a training run read back from TensorBoard's event files, an offline
W&B run and an MLflow file store, each step once after a kill and a resume, and the artifact's id unchanged."""

from __future__ import annotations

import json

import pytest

from dihal.artifacts.store import ArtifactStore
from tests.conftest import TINY_BRIDGE, _extract, invoke, run_cli

TRAIN = ["train-bridge", "--layer", "2", "--extract", "latest", *TINY_BRIDGE]


@pytest.fixture()
def extract(tiny_dirs, root):
    args = _extract(tiny_dirs, "--layers", "0,2", "--max-sequences", "24", "--val-fraction", "0.25")
    assert invoke(*args).exit_code == 0
    return root


def _metrics(art) -> list[dict]:
    return [json.loads(line) for line in (art.path / "metrics.jsonl").read_text().splitlines()]


def _scalars(directory, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_holds_every_step_of_metrics_jsonl_and_the_id_does_not_move(extract):
    res = invoke(*TRAIN, "--train-steps", "6", "--report-to", "tensorboard")
    assert res.exit_code == 0, res.output
    art = ArtifactStore(extract).resolve("latest", "bridge")
    rows = _metrics(art)
    loss = _scalars(art.path / "tensorboard", "train_loss")
    assert [s for s, _ in loss] == [r["step"] for r in rows] == list(range(1, 7))
    assert [v for _, v in loss] == pytest.approx([r["train_loss"] for r in rows], rel=1e-6)  # float32 in events
    assert [s for s, _ in _scalars(art.path / "tensorboard", "lr")] == list(range(1, 7))
    val = _scalars(art.path / "tensorboard", "val_loss")
    assert val == [(6, pytest.approx(art.manifest["metrics"]["val_loss"], rel=1e-6))]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(art.path / "tensorboard"))
    acc.Reload()
    assert "loss_curve" in acc.Tags()["images"] and "final/val_loss" in acc.Tags()["scalars"]
    assert art.verify() == []  # the event files are the artifact's, recorded and checked like the rest
    again = invoke(*TRAIN, "--train-steps", "6")
    assert again.exit_code == 0 and f"cache hit: bridge {art.id}" in again.output  # the id does not hash it


@pytest.mark.slow
def test_a_killed_and_resumed_run_keeps_each_step_once(extract):
    args = [*TRAIN, "--train-steps", "10", "--report-to", "tensorboard"]
    killed = run_cli(*args, kill_after=7)  # checkpoints every 2 steps: the kill loses step 7
    assert killed.returncode == -9
    resumed = run_cli(*args)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr + resumed.stdout
    art = ArtifactStore(extract).resolve("latest", "bridge")
    loss = _scalars(art.path / "tensorboard", "train_loss")
    assert [s for s, _ in loss] == list(range(1, 11))
    assert [v for _, v in loss] == pytest.approx([r["train_loss"] for r in _metrics(art)], rel=1e-6)


@pytest.mark.slow
def test_wandb_offline_writes_a_run_whose_summary_holds_the_validation_loss(extract, tmp_path, monkeypatch):
    from tests.wandb_log import summary_and_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    res = invoke(*TRAIN, "--train-steps", "6", "--report-to", "wandb")
    assert res.exit_code == 0, res.output
    art = ArtifactStore(extract).resolve("latest", "bridge")
    (log,) = tmp_path.glob(f"wandb/offline-run-*-bridge-{art.id}/run-bridge-{art.id}.wandb")
    summary, history = summary_and_history(log)
    assert float(summary["val_loss"]) == pytest.approx(art.manifest["metrics"]["val_loss"])
    steps = [int(h["_step"]) for h in history if "train_loss" in h]
    assert steps == list(range(1, 7))
    assert [float(h["train_loss"]) for h in history if "train_loss" in h] == pytest.approx(
        [r["train_loss"] for r in _metrics(art)]
    )
    assert json.loads(summary["loss_curve/_type"]) == "image-file"
    assert not list(art.path.glob("wandb*"))  # W&B writes where its own settings say, not into the artifact


@pytest.mark.slow
def test_mlflow_file_store_read_back_through_its_client(extract, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    res = invoke(*TRAIN, "--train-steps", "6", "--report-to", "mlflow")
    assert res.exit_code == 0, res.output
    art = ArtifactStore(extract).resolve("latest", "bridge")
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dihal").experiment_id])
    assert run.info.run_name == f"bridge/{art.id}" and run.data.params["layer"] == "2"
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history] == list(range(1, 7))
    assert [m.value for m in history] == pytest.approx([r["train_loss"] for r in _metrics(art)])
    assert run.data.metrics["final_val_loss"] == pytest.approx(art.manifest["metrics"]["val_loss"])
    assert [f.path for f in client.list_artifacts(run.info.run_id)] == ["loss_curve.png"]


def test_a_tracker_that_is_not_installed_or_unknown_is_one_line(extract, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    res = invoke(*TRAIN, "--train-steps", "2", "--report-to", "wandb", "--dry-run")
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        "error: --report-to wandb needs the wandb package; pip install 'dihal[wandb]'"
    ]
    bad = invoke("train-prior", "--report-to", "tensorbored", "--dry-run")
    assert bad.exit_code == 2 and "unknown --report-to 'tensorbored'" in bad.output
    assert invoke("sweep", "--report-to", "none", "--layers", "1", "--dry-run").exit_code == 0


# -- every progress line is dihal's ----------------------------------------------------------------------------
def test_a_libraries_tqdm_bar_is_dihals_progress_in_a_piped_log(capsys, monkeypatch):
    """What transformers' GGUF conversion, hub downloads and datasets draw with tqdm: plain lines, no carriage
    return, and only the outermost of nested bars."""
    from dihal.cli import ui

    monkeypatch.setattr(ui, "make_progress", lambda: ui.PlainProgress(0.0))  # as in a piped log, every line
    ui.route_third_party_bars()
    from tqdm.auto import tqdm

    for _ in tqdm(range(3), desc="Fetching 3 files"):
        for _ in tqdm(range(4), desc="one file"):  # a nested bar counts silently
            pass
    err = capsys.readouterr().err
    assert "\r" not in err and "one file" not in err
    lines = err.splitlines()
    assert lines[0] == "Fetching 3 files: started, 3 items to do"
    assert lines[-1].startswith("Fetching 3 files: 3/3 items (100%)") and lines[-1].endswith("(finished)")


def test_a_bar_an_earlier_command_left_open_does_not_silence_the_next_commands(capsys, monkeypatch):
    """Commands run in one process (the API, a notebook, the tests' in-process CLI): a library bar an earlier one
    opened and never closed made every later bar count silently, as if nested in it (the suite's piped-log test
    then saw no line at all when it ran after such a command in the same worker)."""
    from dihal.cli import ui

    monkeypatch.setattr(ui, "make_progress", lambda: ui.PlainProgress(0.0))
    ui.route_third_party_bars()
    from tqdm.auto import tqdm

    left_open = tqdm(total=5, desc="an earlier command's download")
    left_open.update(1)  # never closed
    capsys.readouterr()
    ui.route_third_party_bars()  # the next command
    for _ in tqdm(range(2), desc="Fetching 2 files"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "Fetching 2 files: started, 2 items to do" and lines[-1].endswith("(finished)"), lines


@pytest.mark.slow
def test_the_first_conversion_into_a_fresh_cache_prints_plain_lines_in_a_piped_log(tmp_path):
    proc = run_cli(
        "extract", "--model", "smollm2-135m", "--max-sequences", "4", "--layers", "0", "--device", "cpu",
        env={"DIHAL_CACHE": str(tmp_path / "fresh-cache"), "DIHAL_ROOT": str(tmp_path / "runs")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "\r" not in out
    assert "Converting and de-quantizing GGUF tensors: started, 272 items to do" in out.splitlines()
    assert any(line.startswith("Converting and de-quantizing GGUF tensors: 272/272 items") for line in out.splitlines())

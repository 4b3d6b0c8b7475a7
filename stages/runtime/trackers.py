"""`--report-to tensorboard|wandb|mlflow|none`: a training run watched where researchers watch one, as HF
Trainer's `report_to` does. Every trained part's artifact is one tracker run, named by its stage and id, its
config the artifact's config: per step the loss, learning rate and tokens/s (stages/diffusion/trainer.py),
the validation loss where it is computed, and at the end the final metrics and the loss curve image.

Only rank 0 reports. The trackers are optional extras (`pip install 'dihal[tensorboard]'`, `[wandb]`,
`[mlflow]`); naming one that is not installed is one line naming the install command. TensorBoard writes
under the artifact (`tensorboard/`); W&B and MLflow where their own settings say (WANDB_PROJECT, WANDB_MODE,
WANDB_DIR; MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME). None of it enters an artifact's id. A resumed run
keeps each step once: TensorBoard purges the steps after the checkpoint, W&B resumes the run of the same id,
MLflow continues the run of the same name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

from dihal.artifacts.errors import DihalError

KINDS = ("tensorboard", "wandb", "mlflow")
PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
_CHOSEN: list[str] = []  # set once per command by configure()


def configure(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The trackers this command reports to (the CLI's repeatable --report-to; `none` or nothing: none),
    each checked installed now, not after an hour of training."""
    chosen = []
    for name in names:
        for part in str(name).split(","):
            part = part.strip().lower()
            if part in ("", "none"):
                continue
            if part not in KINDS:
                raise DihalError(f"unknown --report-to '{part}'; use tensorboard, wandb, mlflow or none")
            if importlib.util.find_spec(PACKAGE[part]) is None:
                raise DihalError(f"--report-to {part} needs the {part} package; pip install 'dihal[{part}]'")
            if part not in chosen:
                chosen.append(part)
    _CHOSEN[:] = chosen
    return tuple(chosen)


class Reporter:
    """What the training loop calls: nothing by default (no tracker, or a rank other than 0)."""

    def resume(self, first_step: int) -> None:
        """The run restarts after `first_step` steps (before any log)."""

    def log(self, step: int, row: dict) -> None:
        """One step's numbers (train_loss, lr, tokens_per_s, val_loss where computed)."""

    def finish(self, metrics: dict, image: Path | None) -> None:
        """The final metrics and the loss curve's PNG."""

    def close(self) -> None:
        pass


class _Reporters(Reporter):
    def __init__(self, reporters: list[Reporter]):
        self.reporters = reporters

    def resume(self, first_step: int) -> None:
        for r in self.reporters:
            r.resume(first_step)

    def log(self, step: int, row: dict) -> None:
        for r in self.reporters:
            r.log(step, row)

    def finish(self, metrics: dict, image: Path | None) -> None:
        for r in self.reporters:
            r.finish(metrics, image)

    def close(self) -> None:
        for r in self.reporters:
            r.close()


def numbers(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as one level of string values (MLflow's params)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class TensorBoard(Reporter):
    def __init__(self, directory: Path, name: str, config: dict):
        self.directory, self.name, self.config, self.writer = directory / "tensorboard", name, config, None
        self.purge = None

    def _writer(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.directory), purge_step=self.purge)
            if self.purge is None:
                import json

                self.writer.add_text("config", f"`{self.name}`\n\n```\n{json.dumps(self.config, indent=1)}\n```")
        return self.writer

    def resume(self, first_step: int) -> None:
        self.purge = first_step + 1 if first_step else None  # steps after the checkpoint are logged again

    def log(self, step: int, row: dict) -> None:
        writer = self._writer()
        for key, value in numbers(row).items():
            if key != "step":
                writer.add_scalar(key, value, step)
        writer.flush()  # on disk at once: a watcher sees it, and a kill loses no step before the checkpoint

    def finish(self, metrics: dict, image: Path | None) -> None:
        writer = self._writer()
        for key, value in numbers(metrics).items():
            writer.add_scalar(f"final/{key}", value, int(metrics.get("steps", 0)))
        if image is not None and image.is_file():
            import numpy as np
            from PIL import Image

            writer.add_image("loss_curve", np.asarray(Image.open(image).convert("RGB")), dataformats="HWC")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB(Reporter):
    def __init__(self, name: str, run_id: str, config: dict):
        import wandb

        project = os.environ.get("WANDB_PROJECT", "dihal")
        self.run = wandb.init(project=project, name=name, id=run_id, config=config, resume="allow", reinit="create_new")

    def log(self, step: int, row: dict) -> None:  # W&B keeps a run's steps increasing: a step logged before a
        self.run.log({k: v for k, v in numbers(row).items() if k != "step"}, step=step)  # kill is dropped

    def finish(self, metrics: dict, image: Path | None) -> None:
        import wandb

        for key, value in numbers(metrics).items():
            self.run.summary[key] = value
        if image is not None and image.is_file():
            self.run.log({"loss_curve": wandb.Image(str(image))})

    def close(self) -> None:
        self.run.finish()


class MLflow(Reporter):
    def __init__(self, name: str, config: dict):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "dihal"))
        found = mlflow.search_runs(filter_string=f"tags.mlflow.runName = '{name}'", output_format="list")
        self.run = mlflow.start_run(run_id=found[0].info.run_id if found else None, run_name=name)
        if not found:
            mlflow.log_params({k: v[:500] for k, v in flat(config).items()})
        self.first = 0

    def resume(self, first_step: int) -> None:
        self.first = first_step

    def log(self, step: int, row: dict) -> None:
        client = self.mlflow.tracking.MlflowClient()
        done = {m.step for m in client.get_metric_history(self.run.info.run_id, "train_loss")} if self.first else set()
        if step not in done:
            self.mlflow.log_metrics({k: v for k, v in numbers(row).items() if k != "step"}, step=step)

    def finish(self, metrics: dict, image: Path | None) -> None:
        self.mlflow.log_metrics({f"final_{k}": v for k, v in numbers(metrics).items()})
        if image is not None and image.is_file():
            self.mlflow.log_artifact(str(image))

    def close(self) -> None:
        self.mlflow.end_run()


_ACTIVE: list[Reporter] = [Reporter()]


def current() -> Reporter:
    """The reporter of the part being trained (a do-nothing one outside a run)."""
    return _ACTIVE[-1]


@contextlib.contextmanager
def run(stage: str, art_id: str, config: dict, directory: Path, rank: int = 0) -> Iterator[Reporter]:
    """One tracker run for one trained artifact, on rank 0, for the trackers configure() chose."""
    if rank != 0 or not _CHOSEN:
        yield Reporter()
        return
    name, reporters = f"{stage}/{art_id}", []
    try:
        for kind in _CHOSEN:
            if kind == "tensorboard":
                reporters.append(TensorBoard(Path(directory), name, config))
            elif kind == "wandb":
                reporters.append(WandB(name, f"{stage}-{art_id}", config))
            else:
                reporters.append(MLflow(name, config))
        both = _Reporters(reporters)
        _ACTIVE.append(both)
        try:
            yield both
        finally:
            _ACTIVE.pop()
    finally:
        for r in reporters:
            r.close()

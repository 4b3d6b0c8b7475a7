"""The options several commands share, and the few steps every command takes.

Every default is read from the config classes (stages/configs.py), so it is written once;
an option that defaults to None takes the protocol's value. Nothing here imports torch: a
command imports its stage (and with it torch) inside its body, after --help has been answered.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import MISSING, fields
from typing import get_type_hints

import typer

from dihal.artifacts.errors import DihalError
from dihal.stages.configs import DataConfig, ExtractConfig

COMMANDS: list[tuple[str, object]] = []  # (name, function), registered by dihal_cli/main.py


def command(name: str | None = None):
    """Marks a function as a `dihal` command (its name with dashes unless given)."""

    def mark(fn):
        COMMANDS.append((name or fn.__name__.replace("_", "-"), fn))
        return fn

    return mark


def default(cls, name: str):
    """The one default of a config field (a tuple as the comma list the CLI reads)."""
    field = cls.__dataclass_fields__[name]
    value = field.default if field.default is not MISSING else field.default_factory()
    return ",".join(map(str, value)) if isinstance(value, tuple) else value  # a tuple is a comma list


def opt(cls, name: str, *flags: str, **kw):
    return typer.Option(default(cls, name), *(flags or ("--" + name.replace("_", "-"),)), **kw)


def given(ctx: typer.Context) -> dict:
    """The running command's own parameters by name, as parsed from its command line (or their defaults);
    the recipe's options are left out (they reach the command as `recipe`). A config is built from them
    by name, with whatever the command resolved itself (--device auto, say) passed on top, by name."""
    skip = RECIPE_PARAMS.get(ctx.command.name.replace("-", "_"), ())
    return {k: v for k, v in ctx.params.items() if k not in skip}


def build(cls, values: dict, **extra):
    """cls from the command's parameters that are its fields (by name), with `extra` on top."""
    names = {f.name for f in fields(cls)}
    return cls(**{**{k: v for k, v in values.items() if k in names}, **extra})


# -- shared options -------------------------------------------------------------------------------------
Root = typer.Option("runs", "--root", envvar="DIHAL_ROOT", help="Artifact root.")
Model = opt(ExtractConfig, "model", help="Builtin name, local directory, .gguf file, or hub id.")
Dataset = typer.Option(
    [default(DataConfig, "dataset")],
    "--dataset",
    help="Builtin 'pydoc', local .txt/.jsonl/.json/.parquet files or glob (JSON lines also .gz/.zst), Dolma as "
    "published (dolma:v1_7, a URL list, or downloaded shards), a hub id, or generate:ID (a generate artifact's "
    "token ids). Repeat it to mix sources (--mix).",
)
Mix = typer.Option(None, "--mix", help="With repeated --dataset: each one's share of the sequences, e.g. 0.5,0.5.")
SeqLen = opt(DataConfig, "seq_len")
MaxSeq = opt(DataConfig, "max_sequences")
StoreDtype = opt(ExtractConfig, "store_dtype", help="auto (float16 per layer where it fits), float16 or float32.")
Device = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
Dtype = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16.")
Seed = typer.Option(0, "--seed")
Force = typer.Option(False, "--force", help="Recompute even when a complete artifact exists.")
DryRun = typer.Option(False, "--dry-run", help="Validate every argument, print the plan; load no weights or data.")
Trust = typer.Option(False, "--trust-remote-code", help="Allow code shipped with a model to run (read it first).")
AsJson = typer.Option(False, "--json", help="Print JSON.")

ReportTo = typer.Option(
    [],
    "--report-to",
    help="Watch training in tensorboard (under the artifact), wandb or mlflow (their own settings); repeatable; "
    "none by default. Rank 0 reports; the id does not change.",
    rich_help_panel="Watching",
)

# -- a trained part's recipe on the command line ----------------------------------------------------------
# field -> (flag, type, help); None (the default) keeps the protocol's value. This order is the order
# of a sweep's, a comparison's and a confirm's `overrides`, which their artifact ids hash.
RECIPE = {
    "steps": ("--train-steps", int, "Optimizer steps (the protocol's if omitted)."),
    "width": ("--width", int, "Network width."),
    "depth": ("--depth", int, "Network depth (the decoder's is fixed)."),
    "batch_size": ("--batch-size", int, "Sequences per optimizer step."),
    "epochs": ("--epochs", int, "Epochs instead of steps."),
    "lr": ("--lr", float, "Peak learning rate."),
    "warmup": ("--warmup", int, "Warm-up steps."),
    "ema": ("--ema", float, "EMA decay, in [0, 1)."),
    "heads": ("--heads", int, "Attention heads."),
    "eval_every": ("--eval-every", int, "Steps between validations."),
    "checkpoint_every": ("--checkpoint-every", int, "Steps between checkpoints."),
    "compile": ("--compile", bool, "Train the step under torch.compile (its own id: other rounding)."),
    "keep_weights": ("--keep-weights", str, "What a complete part keeps: final+ema, ema or ema-bfloat16."),
}


RECIPE_PARAMS: dict[str, set[str]] = {}  # command function -> the parameters recipe_options added to it


def recipe_options(batch_flag: str = "--batch-size", exclude: tuple[str, ...] = ()):
    """Adds every RECIPE option to a command (written once, here) and hands the command the ones the
    user gave as `recipe`, a tuple of (field, value) pairs in RECIPE's order."""
    names = [k for k in RECIPE if k not in exclude]

    def wrap(fn):
        sig = inspect.signature(fn)
        added = []
        for name in names:
            flag, kind, text = RECIPE[name]
            flag = batch_flag if name == "batch_size" else flag
            param = "train_" + name if name == "batch_size" and batch_flag != "--batch-size" else name
            option = typer.Option(None, flag, help=text, rich_help_panel="Recipe (default: the protocol's)")
            added.append(
                (name, inspect.Parameter(param, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind | None))
            )

        report = inspect.Parameter("report_to", inspect.Parameter.KEYWORD_ONLY, default=ReportTo, annotation=list[str])
        RECIPE_PARAMS[fn.__name__] = {p.name for _, p in added} | {report.name}  # not the command's own (given())

        @functools.wraps(fn)
        def command(**kwargs):
            from dihal.stages.runtime import trackers

            trackers.configure(kwargs.pop("report_to"))  # checked now, not after an hour of training
            given = tuple((name, kwargs.pop(p.name)) for name, p in added)
            try:
                return fn(**kwargs, recipe=tuple((k, v) for k, v in given if v is not None))
            finally:
                trackers.configure([])  # this command's choice, not the next one's in the same process

        kept = [p for p in sig.parameters.values() if p.name != "recipe"]
        command.__signature__ = sig.replace(parameters=kept + [p for _, p in added] + [report])
        command.__annotations__ = {**get_type_hints(fn), **{p.name: p.annotation for _, p in added}}
        command.__annotations__["report_to"] = list[str]
        return command

    return wrap


def protocol_opt(cls):
    from dihal.stages.configs import PROTOCOLS

    return opt(cls, "protocol", help=f"One of {', '.join(PROTOCOLS)} (every recipe field overridable).")


def seeds(spec: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise DihalError(f"cannot read --seeds '{spec}'; use a comma list like 0,1,2") from None


def data_sources(datasets: list[str], mix: str | None) -> dict:
    """DataConfig's dataset, also and mix from repeated --dataset and --mix (the extract stage
    writes each generate:<ref> with its artifact's full id)."""
    return {"dataset": datasets[0], "also": tuple(datasets[1:]), "mix": numbers(mix, "--mix") if mix else ()}


def condition_default(cls) -> str:
    """--condition-noise's one default, as the kind:value the option reads."""
    return f"{default(cls, 'condition_from')}:{default(cls, 'condition_noise'):g}"


def count_or_auto(spec: str, flag: str) -> int | None:
    """A whole number >= 1, or 'auto' (None: the stage sizes it)."""
    if spec == "auto":
        return None
    try:
        value = int(spec)
    except ValueError:
        raise DihalError(f"cannot read {flag} '{spec}'; use a whole number or auto") from None
    if value < 1:
        raise DihalError(f"{flag} must be at least 1 (or auto), got {value}")
    return value


def comma_list(spec: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in spec.split(",") if a.strip())


def numbers(spec: str, flag: str, kind=float) -> tuple:
    """A comma list of numbers (NaN and infinity are left for the config to refuse)."""
    try:
        return tuple(kind(x) for x in comma_list(spec))
    except ValueError:
        raise DihalError(
            f"cannot read {flag} '{spec}'; use a comma list like {'0,0.7,1' if kind is float else '1,5'}"
        ) from None


# -- hardware and the process group -----------------------------------------------------------------------
def device_and_dtype(device: str, dtype: str, dry_run: bool = False) -> tuple[str, str]:
    """--device and --dtype as configs record them: the device type (`cuda`, never `cuda:1`: an
    artifact's id must not depend on a GPU's index or a rank) and a concrete dtype ('auto' resolved
    for this machine). A real run also takes its device: under torchrun each rank joins the process
    group and makes the GPU of its LOCAL_RANK current; one process makes cuda:N current."""
    from dihal.stages.lm.models import dtype_name, resolve_device
    from dihal.stages.runtime import dist

    device = resolve_device(device, check=not dry_run)
    dist.check(device)
    if not dry_run:
        device = dist.join(device)
    return dist.device_type(device), dtype_name(dtype, device)


def rank0() -> bool:
    from dihal.stages.runtime import dist

    return dist.is_rank0()

"""The `dihal` command: the Typer app, its global options, and the one-line error rule.

Commands live one module per group, each a screen per command (parse -> config -> stage -> print):

    locate.py   extract, score, sweep
    replace.py  train-bridge, train-prior, train-decoder, train-autoencoder
    use.py      generate, evaluate
    claims.py   compare, confirm
    share.py    export, import
    runs.py     runs list/show/latest/verify/rm/gc

Shared options and defaults are in options.py (read from stages/configs.py), every table in
tables.py, progress and errors in ui.py. Nothing imported here loads torch, transformers, scipy
or pandas, so `dihal --help` answers at once; each command imports its stage when it runs.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError, version

import typer
from typer.core import TyperGroup

try:  # typer >= 0.22 carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - an older typer on top of click
    from click import exceptions as click_errors

from dihal.cli import claims, locate, replace, runs, share, use  # noqa: F401  (each registers its commands)
from dihal.cli.options import COMMANDS
from dihal.cli.ui import LOG_EVERY, console, err_console, route_third_party_bars, user_errors
from dihal.stages.configs import DIST_TIMEOUT_ENV, DIST_TIMEOUT_MINUTES


class OneLineErrors(TyperGroup):
    """A usage error (an unknown option, a value that is not a number) is one `error:` line and exit
    2, like every other bad input, instead of click's framed usage box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = code if isinstance(code, int) else 0
        except click_errors.NoArgsIsHelpError as exc:
            typer.echo(exc.ctx.get_help())
            code = 2
        except click_errors.UsageError as exc:
            where = f"; see '{exc.ctx.command_path} --help'" if exc.ctx is not None else ""
            err_console.print(f"[red]error:[/red] {exc.format_message()}{where}", highlight=False, soft_wrap=True)
            code = 2
        except typer.Abort:
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=OneLineErrors,
    help="dihal: locate where diffusion should enter a language model, then put it there. Method: docs/method.md.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
ORDER = (
    "extract score train-bridge evaluate generate sweep confirm train-prior train-decoder train-autoencoder compare"
    " export import"
).split()
for _name, _fn in sorted(COMMANDS, key=lambda c: ORDER.index(c[0])):  # the order of the pipeline
    app.command(_name)(user_errors(_fn))
app.add_typer(runs.app, name="runs")


def _version(value: bool) -> None:
    if value:
        try:
            console.print(f"dihal {version('dihal')}")
        except PackageNotFoundError:
            console.print("dihal 0+unknown")
        raise typer.Exit()


@app.callback()
@user_errors
def callback(
    _: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
    cache_dir: str | None = typer.Option(
        None, "--cache-dir", help="Converted models (default $DIHAL_CACHE, else ~/.cache/dihal)."
    ),
    log_every: float = typer.Option(
        LOG_EVERY["seconds"], "--log-every", help="Seconds between log lines (0: every step)."
    ),
    threads: int | None = typer.Option(
        None, "--threads", help="CPU threads for torch (default: its own, one per core; two jobs: 1 each)."
    ),
    dist_timeout: float = typer.Option(
        DIST_TIMEOUT_MINUTES,
        "--dist-timeout",
        envvar=DIST_TIMEOUT_ENV,
        help="Minutes a torchrun rank waits for the others (a sweep's slowest layer).",
    ),
    strict_cache: bool = typer.Option(
        False,
        "--strict-cache",
        envvar="DIHAL_STRICT_CACHE",
        help="Recompute a cached artifact made by other code (another dihal version or git commit); scripts/ set it.",
    ),
) -> None:
    """Stages: extract -> score -> train-bridge -> evaluate / generate; sweep trains one bridge per layer."""
    from dihal.artifacts.errors import DihalError

    if not 0 <= log_every < float("inf"):
        raise DihalError(f"--log-every must be a number of seconds >= 0 (0: every step), got {log_every}")
    route_third_party_bars()  # conversion, download and datasets bars as dihal's own progress
    if threads is not None:
        if threads < 1:
            raise DihalError(f"--threads must be at least 1 (leave it out for one per core), got {threads}")
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read when torch is imported, by workers too
        if "torch" in sys.modules:  # already imported (a test, or a caller in one process)
            sys.modules["torch"].set_num_threads(threads)
    if not 0 < dist_timeout < float("inf"):
        raise DihalError(f"--dist-timeout must be a positive number of minutes, got {dist_timeout}")
    os.environ[DIST_TIMEOUT_ENV] = f"{dist_timeout:g}"  # read when a rank joins the process group
    if cache_dir:
        os.environ["DIHAL_CACHE"] = cache_dir
    if strict_cache:  # read by the store at every cache check (artifacts/store.py strict_cache)
        os.environ["DIHAL_STRICT_CACHE"] = "1"
    LOG_EVERY["seconds"] = log_every


def main() -> None:
    """The console script."""
    app()

"""Terminal side of the CLI: the rich progress bar, tables, and the one-line error rule."""
from __future__ import annotations

import functools
import json
import sys
from typing import Callable

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from artifacts.errors import DihalError

console = Console()
err_console = Console(stderr=True)


class RichProgress:
    """stages.runtime.progress.Progress drawn as a rich bar with throughput and ETA."""

    def __init__(self) -> None:
        self._bar: Progress | None = None
        self._task = None
        self._unit = "tok"

    def start(self, description: str, total: float, unit: str = "tok") -> None:
        self.stop()
        self._unit = unit
        self._bar = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=err_console, transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task(description, total=total, rate="")

    def advance(self, amount: float) -> None:
        if self._bar is None:
            return
        self._bar.advance(self._task, amount)
        task = self._bar.tasks[0]
        if task.elapsed:
            self._bar.update(self._task, rate=f"{task.completed / task.elapsed:,.0f} {self._unit}/s")

    def log(self, message: str) -> None:
        err_console.print(f"[dim]{message}[/dim]")

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def user_errors(fn: Callable) -> Callable:
    """Bad input -> `error: ...` on one line and exit code 2; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DihalError as exc:
            err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("interrupted: completed chunks/checkpoints are kept; rerun the same command to resume")
            raise typer.Exit(130) from None

    return wrapper


def table(title: str, columns: list[str], rows: list[list], highlight_row: int | None = None) -> Table:
    out = Table(title=title, show_lines=False)
    for column in columns:
        out.add_column(column, overflow="fold")
    for i, row in enumerate(rows):
        out.add_row(*[_fmt(v) for v in row], style="bold green" if i == highlight_row else None)
    return out


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3e}" if value != 0 and abs(value) < 1e-2 else f"{value:.4g}"
    return str(value)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"

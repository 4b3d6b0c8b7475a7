"""Terminal side of the CLI: progress (a rich bar on a terminal, plain lines in a piped log) and
the one-line error rule (`error: ...`, exit 2, never a traceback)."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import out_of_gpu_memory
from dihal.cli.tables import fmt

console = Console()
err_console = Console(stderr=True)


class RichProgress:
    """stages.runtime.progress.Progress drawn as a rich bar with throughput, ETA and the stage's numbers."""

    def __init__(self) -> None:
        self._bar: Progress | None = None
        self._task = None
        self._unit = "tok"

    def start(self, description: str, total: float, unit: str = "tok") -> None:
        self.stop()
        self._unit = unit
        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=err_console,
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task(description, total=total, rate="", info="")

    def advance(self, amount: float, **info: float) -> None:
        if self._bar is None:
            return
        self._bar.advance(self._task, amount)
        task = self._bar.tasks[0]
        fields = {"info": _info(info)} if info else {}
        if task.elapsed:
            fields["rate"] = f"{task.completed / task.elapsed:,.0f} {self._unit}/s"
        self._bar.update(self._task, **fields)

    def log(self, message: str) -> None:
        err_console.print(f"[dim]{message}[/dim]")

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class PlainProgress:
    """The same reports as plain lines for a piped log: one when work starts, then one every
    `every` seconds (step/total, the stage's numbers, rate, ETA), and one when it ends."""

    def __init__(self, every: float = 10.0, stream=None) -> None:
        self.every, self.stream = every, stream or sys.stderr
        self._desc, self._total, self._done, self._unit = "", 0.0, 0.0, "tok"
        self._t0 = self._last = 0.0
        self._info: dict = {}

    def start(self, description: str, total: float, unit: str = "tok") -> None:
        self._desc, self._total, self._done, self._unit, self._info = description, total, 0.0, unit, {}
        self._t0 = self._last = time.monotonic()
        self._line(f"{description}: started, {total:,.0f} {plural(unit, total)} to do")

    def advance(self, amount: float, **info: float) -> None:
        self._done += amount
        self._info.update(info)
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._line(self._status(now))

    def log(self, message: str) -> None:
        self._line(message)

    def stop(self) -> None:
        if self._desc:
            self._line(
                self._status(time.monotonic()) + " (finished)"
                if self._done >= self._total
                else self._status(time.monotonic())
            )
            self._desc = ""

    def _status(self, now: float) -> str:
        elapsed = max(now - self._t0, 1e-9)
        rate = self._done / elapsed
        pct = 100 * self._done / self._total if self._total else 100.0
        eta = (self._total - self._done) / rate if rate > 0 else float("nan")
        parts = [f"{self._desc}: {self._done:,.0f}/{self._total:,.0f} {plural(self._unit, self._total)} ({pct:.0f}%)"]
        if self._info:
            parts.append(_info(self._info))
        parts.append(f"{rate:,.1f} {self._unit}/s")
        parts.append(f"ETA {_duration(eta)}")
        return ", ".join(parts)

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


def plural(unit: str, count: float) -> str:
    """'2,000 steps to do', '1 step'; abbreviations ('tok') and rates ('step/s') keep their one form."""
    return unit if count == 1 or unit == "tok" else unit + "s"


def _info(info: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {fmt(v)}" for k, v in info.items())


def _duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "-"
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


LOG_EVERY = {"seconds": 10.0}  # set by `dihal --log-every`


def make_progress():
    """A rich bar on a terminal, plain lines every --log-every seconds otherwise."""
    return RichProgress() if err_console.is_terminal else PlainProgress(LOG_EVERY["seconds"])


def route_third_party_bars() -> None:
    """The tqdm bars of the libraries dihal calls (transformers' GGUF conversion, hub downloads, datasets')
    drawn as dihal's own progress: a rich bar on a terminal, a plain line every --log-every seconds in a
    piped log, never a carriage-return bar. Only the outermost open bar is drawn (a download's per-file bars
    count silently inside "Fetching N files"), and none while a stage's own bar holds the terminal. Called
    once per command, before any of those libraries is imported (they bind tqdm.auto.tqdm at import); a
    command forgets the bars an earlier command in the same process left open."""
    import tqdm
    import tqdm.auto
    from rich.errors import LiveError

    base = tqdm.std.tqdm
    if getattr(tqdm.auto.tqdm, "dihal", False):  # installed by an earlier command of this process (the API, tests):
        tqdm.auto.tqdm.open_bars.clear()  # a bar it left open (never closed) must not silence this command's
        return

    class DihalBar(base):
        dihal, open_bars = True, []

        def __init__(self, iterable=None, desc=None, total=None, *args, unit="it", **kwargs):
            if total is None and iterable is not None and hasattr(iterable, "__len__"):
                total = len(iterable)
            super().__init__(iterable, desc, total, *args, unit=unit, **{**kwargs, "disable": True})
            self.drawn = None
            if not DihalBar.open_bars and not kwargs.get("disable"):
                drawn = make_progress()
                try:
                    drawn.start((desc or "working").rstrip(". :"), total or 0, "item" if unit == "it" else unit)
                    self.drawn = drawn
                except LiveError:  # a stage's own rich bar is on screen: count silently
                    pass
            DihalBar.open_bars.append(self)

        def __iter__(self):
            try:
                for item in self.iterable:
                    yield item
                    self.update(1)
            finally:
                self.close()

        def update(self, n=1):
            self.n += n
            if self.drawn is not None:
                self.drawn.advance(n)
            return True

        def close(self):
            if self.drawn is not None:
                self.drawn.stop()
                self.drawn = None
            DihalBar.open_bars[:] = [b for b in DihalBar.open_bars if b is not self]  # tqdm's == compares positions

    tqdm.tqdm = tqdm.auto.tqdm = DihalBar


def user_errors(fn: Callable) -> Callable:
    """Bad input -> `error: ...` on one line and exit code 2; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DihalError as exc:
            err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except OSError as exc:  # a last resort: stages turn the ones they expect into DihalError
            where = escape(f" ({exc.filename})" if exc.filename else "")
            err_console.print(
                f"[red]error:[/red] {escape(str(exc.strerror or exc))}{where}; check the path, its permissions and "
                "free space, then rerun",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(2) from None
        except RuntimeError as exc:  # out of GPU memory outside an artifact (a model that does not fit)
            if not out_of_gpu_memory(exc):
                raise
            err_console.print(
                f"[red]error:[/red] out of GPU memory in {fn.__name__.replace('_', '-')}; lower --train-batch / "
                "--batch-size, or use a smaller --dtype or a larger GPU",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("interrupted: completed chunks/checkpoints are kept; rerun the same command to resume")
            raise typer.Exit(130) from None

    return wrapper


def dry(command: str, *configs, plan=None) -> None:
    """--dry-run: every config printed (each has checked itself); with plan=an ExtractConfig, the
    model's config is read too, so that a missing model fails now and not after an hour."""
    if plan is not None:
        from dihal.stages.extract import plan as plan_extract

        plan_extract(plan, dry_run=True)
    for cfg in configs:
        console.print(f"[yellow]dry run[/yellow] {command}: {escape(str(cfg))}", highlight=False, soft_wrap=True)


def report(art) -> None:
    """One line: what the stage made or reused, and where it lives."""
    state = "cache hit" if art.reused else "done"
    made = escape(f" ({art.other_code}; --strict-cache recomputes it)") if art.reused and art.other_code else ""
    console.print(f"[green]{state}[/green]: {art.stage} {art.id} -> {art.path}{made}", highlight=False, soft_wrap=True)

"""`dihal runs ...`: inspect, verify and clean the artifact store (artifacts/store.py)."""

from __future__ import annotations

import json

import typer

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import ArtifactStore
from dihal.cli import options as o
from dihal.cli.tables import runs_table
from dihal.cli.ui import console, user_errors

app = typer.Typer(help="Inspect, verify and clean the artifact store.", no_args_is_help=True)


@app.command("list")
@user_errors
def runs_list(stage: str | None = typer.Option(None, "--stage"), root: str = o.Root) -> None:
    """Every artifact: stage, id, status, key parameters, created, size."""
    store = ArtifactStore(root)
    console.print(runs_table(store.root, list(store.all(stage))))


@app.command("show")
@user_errors
def runs_show(ref: str, root: str = o.Root) -> None:
    """One artifact's manifest and its lineage."""
    store = ArtifactStore(root)
    art = store.resolve(ref, corrupt_ok=True)
    console.print_json(json.dumps(art.manifest, default=str))
    for parent in store.lineage(art):
        console.print(f"  <- {parent.stage} {parent.id} ({parent.status})")


@app.command("latest")
@user_errors
def runs_latest(stage: str, root: str = o.Root) -> None:
    """Print the id of the newest complete artifact of STAGE (for scripts)."""
    print(ArtifactStore(root).resolve("latest", stage).id)


@app.command("verify")
@user_errors
def runs_verify(
    ref: str | None = typer.Argument(None), all_: bool = typer.Option(False, "--all"), root: str = o.Root
) -> None:
    """Recompute every file's checksum against the manifest; exit 1 when anything is missing, altered or
    corrupt. --all checks every complete artifact and names every corrupt one."""
    store = ArtifactStore(root)
    if (ref is None) == (not all_):
        raise DihalError("give an artifact ID or --all")
    found = store.all() if all_ else [store.resolve(ref, corrupt_ok=True)]
    arts = [a for a in found if a.complete or a.status == "corrupt"] if all_ else found
    bad = 0
    for art in arts:
        problems = art.verify()
        bad += bool(problems)
        status = "ok" if not problems else f"{len(problems)} problem(s): " + "; ".join(problems[:5])
        console.print(f"{art.stage}/{art.id}: {status}", highlight=False, soft_wrap=True)
    console.print(f"{len(arts) - bad} of {len(arts)} artifacts verified")
    if bad:
        raise typer.Exit(1)


@app.command("rm")
@user_errors
def runs_rm(
    ref: str, recursive: bool = typer.Option(False, "--recursive", help="Also remove its children."), root: str = o.Root
) -> None:
    """Remove one artifact (refused while others were made from it, unless --recursive)."""
    store = ArtifactStore(root)
    for art in store.remove(store.resolve(ref, corrupt_ok=True), recursive=recursive):
        console.print(f"removed {art.stage}/{art.id}")


@app.command("gc")
@user_errors
def runs_gc(
    older_than: str = typer.Option("24h", "--older-than", help="Age such as 30m, 24h or 7d."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be removed."),
    root: str = o.Root,
) -> None:
    """Remove failed, incomplete, corrupt and manifest-less artifacts older than --older-than (never one
    being written)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        seconds = float(older_than[:-1]) * units[older_than[-1]]
    except (KeyError, ValueError, IndexError):
        seconds = float("nan")
    if not seconds >= 0 or seconds == float("inf"):
        raise DihalError(f"cannot read --older-than '{older_than}'; use a number and s, m, h or d, like 24h")
    gone = ArtifactStore(root).collect_garbage(seconds, dry_run=dry_run)
    for art in gone:
        console.print(f"{'would remove' if dry_run else 'removed'} {art.stage}/{art.id} ({art.status})")
    console.print(f"{len(gone)} artifact(s) {'to remove' if dry_run else 'removed'}")

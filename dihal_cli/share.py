"""Share: `dihal export` (a bridge as a package that leaves its store, to a folder or the hub) and `dihal import`
(a package into a store, under its own id). The package's layout: stages/export.py; docs/sharing.md.
"""

from __future__ import annotations

import typer

from dihal.artifacts.store import ArtifactStore
from dihal.cli import options as o
from dihal.cli.ui import console, dry, report
from dihal.stages.configs import ExportConfig


@o.command()
def export(
    out: str = typer.Argument(..., help="A new (or empty) folder for the package."),
    bridge: str = typer.Option("latest", "--bridge", help="Bridge artifact: id, prefix or latest."),
    sample_steps: int = o.opt(ExportConfig, "sample_steps", help="The package's default Euler steps per position."),
    push_to_hub: str | None = o.opt(ExportConfig, "push_to_hub", help="Also upload it to this hub repo (owner/name)."),
    private: bool = o.opt(ExportConfig, "private", help="--push-to-hub: create the repo private."),
    seed: int = o.opt(ExportConfig, "seed", help="The package's default noise seed."),
    dry_run: bool = o.DryRun,
    trust_remote_code: bool = o.Trust,
    root: str = o.Root,
) -> None:
    """The bridge alone (weights, statistics, config, model card; no backbone tensor), loadable anywhere with
    dihal.from_pretrained or transformers' AutoModelForCausalLM after `import dihal` (docs/sharing.md)."""
    cfg = ExportConfig(out=out, sample_steps=sample_steps, seed=seed, push_to_hub=push_to_hub, private=private)
    if dry_run:
        return dry("export", cfg)
    from dihal.stages import export as stage

    store = ArtifactStore(root)
    art = store.resolve(bridge, "bridge")
    path = stage.export_bridge(
        art, cfg.out, store, steps=cfg.sample_steps, seed=cfg.seed, trust_remote_code=trust_remote_code
    )
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    console.print(f"[green]exported[/green]: bridge {art.id} -> {path} ({size / 2**20:.1f} MiB)", highlight=False)
    if cfg.push_to_hub:
        url = stage.push(path, cfg.push_to_hub, private=cfg.private)
        console.print(f"[green]pushed[/green]: {cfg.push_to_hub} ({url})", highlight=False, soft_wrap=True)


@o.command("import")
def import_(
    bridge: str = typer.Argument(..., help="An exported bridge: its folder or a hub repo id."),
    base_model: str | None = typer.Option(
        None, "--base-model", help="Its base model as --model takes it (default: the builtin or hub id it names)."
    ),
    revision: str | None = typer.Option(None, "--revision", help="A hub repo id's revision."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the package (its files' sha256s); copy nothing."),
    root: str = o.Root,
) -> None:
    """Bring an exported bridge into the store as the artifact it was exported from (its own id), so
    evaluate, generate and compare run on it. Its base model must hash to what the package names."""
    from dihal.stages import export as stage

    package = stage.read(bridge, revision)
    model = base_model or stage.default_base(package)
    if dry_run:
        return console.print(
            f"[yellow]dry run[/yellow] import: bridge {package.config['bridge']} on {model}", highlight=False
        )
    report(stage.import_bridge(package, ArtifactStore(root), model))

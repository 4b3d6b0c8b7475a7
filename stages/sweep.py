"""`dihal sweep`: one bridge per layer under one fixed protocol, then docs/method.md section 4 claim 1:
Spearman rho between the geometry score S_l and the negated validation bridge loss."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import pandas as pd
from scipy.stats import spearmanr

from artifacts.errors import DihalError
from artifacts.store import Artifact, ArtifactStore
from stages import bridge as bridge_stage
from stages import evaluate as eval_stage
from stages import score as score_stage
from stages.diffusion import trainer
from stages.runtime import plotting
from stages.runtime.progress import NullProgress, Progress

STAGE = "sweep"


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    layers: tuple[int, ...]
    protocol: str = "sweep-tiny"
    overrides: tuple[tuple[str, object], ...] = ()  # protocol fields changed for every layer alike
    sample_steps: int = 8  # Euler steps for each bridge's fidelity
    eval_limit: int = 32
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.layers:
            raise DihalError("--layers must name at least one layer")
        if self.sample_steps < 1 or self.eval_limit < 1:
            raise DihalError("--sample-steps and --eval-limit must be at least 1")
        for layer in self.layers:  # every layer's recipe is valid before the first one trains
            bridge_stage.BridgeConfig.from_protocol(layer, self.protocol, **dict(self.overrides))


def run(
    cfg: SweepConfig,
    extract: Artifact,
    score_art: Artifact,
    store: ArtifactStore,
    *,
    force: bool = False,
    progress: Progress | None = None,
    trust_remote_code: bool = False,
) -> Artifact:
    progress = progress or NullProgress()
    config = {**asdict(cfg), "overrides": dict(cfg.overrides)}
    parents = {"extract": extract.id, "score": score_art.id}
    if cached := store.cached(STAGE, config, parents, force=force):
        return cached
    if score_art.manifest.get("parents", {}).get("extract") != extract.id:
        raise DihalError(
            f"score {score_art.id} was made from extract {score_art.manifest.get('parents', {}).get('extract')}, "
            f"not {extract.id}; pass a --score of this extract or leave --score out to score it now"
        )
    scores = score_stage.load_table(score_art).set_index("layer")
    missing = [layer for layer in cfg.layers if layer not in scores.index]
    if missing:
        raise DihalError(f"layer {missing[0]} is not a candidate of score {score_art.id}; sweep its candidates only")
    bridge_cfg = lambda layer: bridge_stage.BridgeConfig.from_protocol(  # noqa: E731
        layer,
        cfg.protocol,
        **dict(cfg.overrides),
        seed=cfg.seed,
        device=cfg.device,
        precision=trainer.precision_for(cfg.dtype),
    )
    rank, world = trainer.distributed()
    if world > 1:  # under torchrun: rank r trains layers r, r + W, ... each on its own; rank 0 sums up
        with trainer.local():
            for layer in cfg.layers[rank::world]:
                progress.log(f"rank {rank}, layer {layer}: bridge under protocol {cfg.protocol}")
                bridge_stage.run(bridge_cfg(layer), extract, store, progress=progress if rank == 0 else None)
        trainer.barrier()
        if rank != 0:
            return None
    loaded = None
    rows = []
    for layer in cfg.layers:
        progress.log(f"layer {layer}: bridge under protocol {cfg.protocol}")
        with trainer.local():
            bridge_art = bridge_stage.run(bridge_cfg(layer), extract, store, progress=progress)
        fcfg = eval_stage.FidelityConfig(
            sample_steps=(cfg.sample_steps,), limit=cfg.eval_limit, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype
        )
        if store.cached(eval_stage.STAGE, {"kind": "fidelity", **asdict(fcfg)}, {"bridge": bridge_art.id}) is None:
            loaded = loaded or eval_stage.backbone_for(bridge_art, cfg.device, cfg.dtype, trust_remote_code)
        fid_art = eval_stage.run_fidelity(fcfg, bridge_art, store, loaded=loaded)
        fid = fid_art.manifest["metrics"]["fidelity"][0]
        rows.append(
            {
                "layer": layer,
                "S": float(scores.loc[layer, "S"]),
                "score_rank": int(scores.loc[layer, "rank"]),
                "val_loss": bridge_art.manifest["metrics"]["val_loss"],
                "bridge": bridge_art.id,
                **{k: v for k, v in fid.items() if k != "steps"},
            }
        )
    table = pd.DataFrame(rows)
    summary = summarize(table, int(score_stage.load_table(score_art).set_index("layer")["S"].idxmax()))
    with store.writing(
        STAGE,
        config,
        parents,
        force=force,
        seed=cfg.seed,
        device=cfg.device,
        extra={"model": extract.manifest.get("model")},
    ) as art:
        table.to_csv(art.file("sweep.csv"), index=False)
        table.to_parquet(art.file("sweep.parquet"), index=False)
        art.file("summary.json").write_text(json.dumps(summary, indent=2))
        plot(table, summary, art.file("sweep.png"))
        art.manifest["metrics"] = summary
    return art


def summarize(table: pd.DataFrame, l_star: int) -> dict:
    rho, p_value = spearmanr(table["S"], -table["val_loss"]) if len(table) > 1 else (float("nan"), float("nan"))
    oracle = int(table.loc[table["val_loss"].idxmin(), "layer"])
    worst = int(table.loc[table["val_loss"].idxmax(), "layer"])
    loss = table.set_index("layer")["val_loss"]
    return {
        "spearman_rho": float(rho),
        "p_value": float(p_value),
        "oracle_layer": oracle,
        "worst_layer": worst,
        "l_star": l_star,
        "l_star_val_loss": float(loss.get(l_star, float("nan"))),
        "oracle_val_loss": float(loss[oracle]),
        "worst_val_loss": float(loss[worst]),
        "layers": table["layer"].tolist(),
    }


def plot(table: pd.DataFrame, summary: dict, path) -> None:
    fig, ax = plotting.figure()
    ax.plot(table["layer"], table["S"], marker="o", color="black", label="geometry score S")
    ax.set_xlabel("layer")
    ax.set_ylabel("S")
    ax2 = ax.twinx()
    ax2.plot(table["layer"], table["val_loss"], marker="s", color="tab:red", label="validation bridge loss")
    ax2.set_ylabel("validation bridge loss", color="tab:red")
    ax.axvline(summary["l_star"], color="black", linestyle="--", alpha=0.6)
    ax.axvline(summary["oracle_layer"], color="tab:red", linestyle=":", alpha=0.6)
    fig.legend(loc="upper right")
    plotting.save(
        fig,
        ax,
        path,
        f"Spearman rho(S, -loss) = {summary['spearman_rho']:.3f} (p = {summary['p_value']:.2g}); "
        f"l* = {summary['l_star']}, oracle = {summary['oracle_layer']}",
    )

"""`dihal score`: METHOD.md section 1 as code (locate: geometry proxies per layer).

For every candidate layer l, X (n x D, float64) holds the states at the SAME n sampled token
positions. Proxies:
    m_curv = median_i 1 / lambda_max(C_i)     C_i: covariance of x_i's k nearest points (self included)
    m_mono = median (v^T P v) / (v^T v)       P = (Sigma + eps I)^-1, v = x_a - x_b over random pairs
    k_hat  = tr(Sigma) / lambda_max(Sigma)
    S_l    = z(m_curv)_l + z(m_mono)_l - z(k_hat)_l,   l* = argmax S
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch

from artifacts import hidden_states as hs
from artifacts.errors import DihalError
from artifacts.store import Artifact, ArtifactStore
from stages import plotting
from stages.progress import NullProgress, Progress

STAGE = "score"
NORMALIZATIONS = ("none", "rms", "standardize")
PROXIES = ("m_curv", "m_mono", "k_hat")


@dataclass(frozen=True)
class ScoreConfig:
    tokens: int = 4096
    k: int = 64
    eps_rel: float = 1e-3
    pairs: int = 8192
    normalize: str = "none"
    exclude_positions: str = "0"
    candidates: str | None = None  # None: 1..L-1
    split: str = "train"
    seed: int = 0
    device: str = "cpu"
    chunk: int = 512  # points per batched kNN / Gram block; bounds memory, not results


# -- sampling and normalization -----------------------------------------------------------------
def sample_positions(group, split: str, n: int, exclude: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n (sequence, position) pairs uniformly without replacement from the valid positions."""
    seqs = hs.split_indices(group, split)
    mask = np.asarray(group["attention_mask"].oindex[seqs]).astype(bool)
    mask[:, [p for p in exclude if p < mask.shape[1]]] = False
    rows, cols = np.nonzero(mask)
    if n > rows.size:
        raise DihalError(f"--tokens {n} asked for, but the {split} split has only {rows.size} valid positions; "
                         f"lower --tokens or extract more sequences")
    pick = np.sort(np.random.default_rng([seed, 0]).choice(rows.size, size=n, replace=False))
    return seqs[rows[pick]], cols[pick]


def normalize(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "none":
        return x
    if mode == "rms":
        return x / x.pow(2).mean().sqrt()
    if mode == "standardize":
        std = x.std(dim=0, unbiased=False)
        return (x - x.mean(dim=0)) / torch.where(std > 0, std, torch.ones_like(std))
    raise DihalError(f"unknown --normalize '{mode}'; use one of {', '.join(NORMALIZATIONS)}")


# -- the proxies ----------------------------------------------------------------------------------
def knn_indices(x: torch.Tensor, k: int, start: int, stop: int) -> torch.Tensor:
    """(stop-start, k) indices of the k nearest points of x[start:stop] in x, itself included."""
    sq = x.pow(2).sum(1)
    dist2 = sq[start:stop, None] + sq[None, :] - 2.0 * (x[start:stop] @ x.T)
    rows = torch.arange(stop - start, device=x.device)
    dist2[rows, rows + start] = -1.0  # the point itself always comes first, despite rounding
    return torch.topk(dist2, k, dim=1, largest=False).indices


def neighbourhood_lambda_max(x: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """lambda_max(C_i) from each neighbourhood's k x k Gram matrix (same nonzero spectrum as C_i)."""
    k = neighbours.shape[1]
    hood = torch.index_select(x, 0, neighbours.reshape(-1)).view(-1, k, x.shape[1])
    hood -= hood.mean(dim=1, keepdim=True)
    gram = torch.bmm(hood, hood.transpose(1, 2))
    return torch.linalg.eigvalsh(gram)[:, -1] / (k - 1)


def local_lambda_max(x: torch.Tensor, k: int, chunk: int = 512) -> torch.Tensor:
    """lambda_max(C_i) for every point; blocks of points run on a thread pool (torch frees the GIL),
    so memory stays O(chunk * (n + k * D)) for any n."""
    def block(start: int) -> torch.Tensor:
        stop = min(start + chunk, x.shape[0])
        return neighbourhood_lambda_max(x, knn_indices(x, k, start, stop))

    starts = range(0, x.shape[0], chunk)
    if x.device.type != "cpu":
        return torch.cat([block(s) for s in starts])
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        return torch.cat(list(pool.map(block, starts)))


def local_curvature(x: torch.Tensor, k: int, chunk: int = 512) -> float:
    lam = local_lambda_max(x, k, chunk)
    scale = float(x.var(dim=0).sum()) / x.shape[1] if x.shape[0] > 1 else 1.0
    positive = lam[lam > 1e-12 * max(scale, 1e-300)]  # exact duplicates give 0 up to rounding
    if positive.numel() == 0:
        return float("nan")
    return float(np.median((1.0 / positive).cpu().numpy()))


def covariance(x: torch.Tensor) -> torch.Tensor:
    centered = x - x.mean(dim=0)
    return centered.T @ centered / (x.shape[0] - 1)


def sample_pairs(n: int, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """m index pairs (a, b) with a != b, uniformly."""
    rng = np.random.default_rng([seed, 1])
    a = rng.integers(0, n, size=m)
    b = rng.integers(0, n - 1, size=m)
    return a, b + (b >= a)


def global_monotonicity(x: torch.Tensor, eig: torch.Tensor, vecs: torch.Tensor, eps_rel: float,
                        pairs: tuple[np.ndarray, np.ndarray]) -> float:
    """median (v^T P v)/(v^T v), P = (Sigma + eps I)^-1 = U diag(1/(lambda + eps)) U^T."""
    eps = eps_rel * float(eig.sum()) / x.shape[1]
    a, b = (torch.as_tensor(i, device=x.device) for i in pairs)
    v = x[a] - x[b]
    vv = (v * v).sum(1)
    keep = vv > 0
    whitened = (v[keep] @ vecs) / torch.sqrt(eig + eps)
    ratio = whitened.pow(2).sum(1) / vv[keep]
    return float(np.median(ratio.cpu().numpy()))


def spectrum_stats(eig: torch.Tensor) -> dict[str, float]:
    eig = eig.clamp_min(0)
    total = float(eig.sum())
    p = eig / total if total > 0 else eig
    p = p[p > 0]
    return {
        "k_hat": total / float(eig[-1]) if float(eig[-1]) > 0 else float("nan"),
        "participation_ratio": total ** 2 / float((eig ** 2).sum()) if total > 0 else float("nan"),
        "entropy_rank": float(torch.exp(-(p * p.log()).sum())),
    }


def layer_proxies(x: torch.Tensor, cfg: ScoreConfig, pairs: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    """All proxies of one layer, X already normalized, float64."""
    eig, vecs = torch.linalg.eigh(covariance(x))  # Sigma = U diag(eig) U^T, eig ascending
    return {
        "m_curv": local_curvature(x, cfg.k, cfg.chunk),
        "m_mono": global_monotonicity(x, eig, vecs, cfg.eps_rel, pairs),
        **spectrum_stats(eig),
    }


# -- the combined score -----------------------------------------------------------------------
def zscore(values: pd.Series) -> pd.Series:
    std = values.std(ddof=0)
    if not np.isfinite(std) or std == 0:
        return pd.Series(0.0, index=values.index)
    return (values - values.mean()) / std


def combine(table: pd.DataFrame) -> pd.DataFrame:
    """Adds z_m_curv, z_m_mono, z_k_hat, S and rank (1 = best) to a per-layer proxy table."""
    out = table.copy()
    for proxy in PROXIES:
        out[f"z_{proxy}"] = zscore(out[proxy])
    out["S"] = out["z_m_curv"] + out["z_m_mono"] - out["z_k_hat"]
    out["rank"] = out["S"].rank(ascending=False, method="first").astype(int)
    return out.sort_values("layer").reset_index(drop=True)


# -- the stage ----------------------------------------------------------------------------------
def parse_candidates(spec: str | None, stored: list[int], num_blocks: int) -> list[int]:
    from stages.extract import parse_layers

    layers = list(range(1, num_blocks)) if spec is None else parse_layers(spec, num_blocks)
    missing = [l for l in layers if l not in stored]
    if missing:
        raise DihalError(f"candidate layer {missing[0]} is not in the extract (it holds {_ranges(stored)}); "
                         "pass --candidates within those or extract the layer")
    if len(layers) < 2:
        raise DihalError("--candidates needs at least two layers to z-score across")
    return layers


def _ranges(layers: list[int]) -> str:
    return f"layers {layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else f"layers {layers}"


def validate(cfg: ScoreConfig) -> None:
    if cfg.normalize not in NORMALIZATIONS:
        raise DihalError(f"unknown --normalize '{cfg.normalize}'; use one of {', '.join(NORMALIZATIONS)}")
    if cfg.k < 2:
        raise DihalError("--k must be at least 2")
    if cfg.k >= cfg.tokens:
        raise DihalError(f"--k {cfg.k} must be smaller than --tokens {cfg.tokens}")
    if cfg.pairs < 1:
        raise DihalError("--pairs must be at least 1")
    if cfg.split not in hs.SPLITS:
        raise DihalError("--split must be train or validation")


def score_layers(group, cfg: ScoreConfig, layers: list[int], progress: Progress) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    exclude = [int(p) for p in cfg.exclude_positions.split(",") if p.strip()] if cfg.exclude_positions else []
    seq_idx, pos_idx = sample_positions(group, cfg.split, cfg.tokens, exclude, cfg.seed)
    pairs = sample_pairs(cfg.tokens, cfg.pairs, cfg.seed)
    rows = []
    progress.start("score", len(layers), "layer")
    for layer in layers:
        raw = torch.from_numpy(hs.read_positions(group, layer, seq_idx, pos_idx)).to(cfg.device, torch.float64)
        proxies = layer_proxies(normalize(raw, cfg.normalize), cfg, pairs)
        rows.append({"layer": layer, **proxies, "mean_token_norm": float(raw.norm(dim=1).mean())})
        progress.advance(1)
    progress.stop()
    return combine(pd.DataFrame(rows)), seq_idx, pos_idx


def run(cfg: ScoreConfig, extract: Artifact, store: ArtifactStore, *, force: bool = False,
        progress: Progress | None = None) -> Artifact:
    progress = progress or NullProgress()
    validate(cfg)
    group = hs.open_group(extract.path / "hidden.zarr")
    num_blocks = int(group.attrs["num_blocks"])
    layers = parse_candidates(cfg.candidates, hs.stored_layers(group), num_blocks)
    config, parents = {**asdict(cfg), "candidates": layers, "device": None}, {"extract": extract.id}
    cached = store.cached(STAGE, config, parents)
    if cached and not force:
        return cached
    with store.writing(STAGE, config, parents, force=force, seed=cfg.seed, device=cfg.device,
                       extra={"model": extract.manifest.get("model")}) as art:
        table, seq_idx, pos_idx = score_layers(group, cfg, layers, progress)
        write_outputs(art, table, seq_idx, pos_idx)
        best = int(table.loc[table["S"].idxmax(), "layer"])
        art.manifest["metrics"] = {"l_star": best, "n_tokens": cfg.tokens, "candidates": layers}
    return art


def write_outputs(art: Artifact, table: pd.DataFrame, seq_idx: np.ndarray, pos_idx: np.ndarray) -> None:
    table.to_parquet(art.file("table.parquet"), index=False)
    table.to_csv(art.file("table.csv"), index=False)
    best = table.loc[table["S"].idxmax()]
    summary = {"l_star": int(best["layer"]), "S": float(best["S"]),
               "ranking": table.sort_values("rank")["layer"].astype(int).tolist()}
    art.file("scores.json").write_text(json.dumps(summary, indent=2))
    np.savez(art.file("positions.npz"), sequence=seq_idx, position=pos_idx)
    plot(table, summary["l_star"], art.file("scores.png"), art.config.get("normalize", "none"))


def plot(table: pd.DataFrame, l_star: int, path, normalize_mode: str) -> None:
    fig, ax = plotting.figure()
    for column, label in (("z_m_curv", "z(m_curv)"), ("z_m_mono", "z(m_mono)"), ("z_k_hat", "z(k_hat)")):
        ax.plot(table["layer"], table[column], marker=".", label=label, alpha=0.8)
    ax.plot(table["layer"], table["S"], marker="o", color="black", linewidth=2, label="S")
    ax.axvline(l_star, color="red", linestyle="--", label=f"l* = {l_star}")
    ax.set_xlabel("layer")
    ax.set_ylabel("z-score")
    ax.legend()
    plotting.save(fig, ax, path, f"DiHAL geometry score (normalize={normalize_mode})")


def load_table(art: Artifact) -> pd.DataFrame:
    return pd.read_parquet(art.file("table.parquet"))

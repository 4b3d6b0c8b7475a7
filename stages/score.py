"""`dihal score`: METHOD §1 as code (locate: geometry proxies per layer).

For every candidate layer l, X (n x D, float64) holds the states at the SAME n sampled token
positions. Proxies:
    m_curv = median_i 1 / lambda_max(C_i)     C_i: covariance of x_i's k nearest points (self included)
    m_mono = median (v^T P v) / (v^T v)       P = (Sigma + eps I)^-1, v = x_a - x_b over random pairs
    k_hat  = tr(Sigma) / lambda_max(Sigma)
    S_l    = z(m_curv)_l + z(m_mono)_l - z(k_hat)_l,   l* = argmax S

Options beyond the paper (the default is the paper's definition alone):
    --bootstrap B     B more draws of n positions (seeds [seed, 0, b]): per layer the spread of S,
                      its rank range, and how often it is l* (bootstrap.csv, columns S_boot_*)
    --outlier-mads M  also the robust proxies, from the positions whose norm at that layer is at most
                      median + M * 1.4826 * MAD (columns *_robust, S_robust, l*_robust)

How m_curv is computed: K = X X^T once (n x n, symmetric blocks); each point's k nearest come from
a top-k over its row of K, and lambda_max(C_i) from the k x k Gram matrix K[N_i, N_i], centered,
which has the same nonzero spectrum as (k-1) C_i. Beyond FULL_PRODUCTS_MAX_BYTES the rows of K
are computed per block and the Gram matrices from the gathered neighbourhoods instead.
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import torch

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job
from dihal.stages import registry
from dihal.stages.configs import NORMALIZATIONS, ScoreConfig, excluded_positions
from dihal.stages.runtime import bootstrap, dist, plotting
from dihal.stages.runtime.allocator import keep_freed_memory
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "score"
CACHE_VERSION = 1  # bump whenever this stage's bytes change (tests/test_golden.py says when)


# -- sampling and normalization -----------------------------------------------------------------
def draw_rng(seed: int, draw: int) -> np.random.Generator:
    """Draw 0 is the score itself; draws 1..B are the bootstrap's fresh samples of positions."""
    return np.random.default_rng([seed, 0] if draw == 0 else [seed, 0, draw])


def sample_positions(
    group, split: str, n: int, exclude: list[int], seed: int, draw: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """n (sequence, position) pairs uniformly without replacement from the valid positions."""
    seqs = hs.split_indices(group, split)
    mask = np.asarray(group["attention_mask"].oindex[seqs]).astype(bool)
    mask[:, [p for p in exclude if p < mask.shape[1]]] = False
    rows, cols = np.nonzero(mask)
    if n > rows.size:
        raise DihalError(
            f"--tokens {n} asked for, but the {split} split has only {rows.size} valid positions; "
            f"lower --tokens or extract more sequences"
        )
    pick = np.sort(draw_rng(seed, draw).choice(rows.size, size=n, replace=False))
    return seqs[rows[pick]], cols[pick]


def ridge_rng(seed: int, draw: int) -> np.random.Generator:
    """The ridge proxies' positions of a draw, apart from the geometry's."""
    return np.random.default_rng([seed, draw, 23])


def ridge_sample(group, cfg: ScoreConfig, exclude: list[int], draw: int) -> tuple[np.ndarray, np.ndarray]:
    """max(--tokens, Embeddings.ROWS) positions of the split for the ridge proxies (all of them, if fewer)."""
    seqs = hs.split_indices(group, cfg.split)
    mask = np.asarray(group["attention_mask"].oindex[seqs]).astype(bool)
    mask[:, [p for p in exclude if p < mask.shape[1]]] = False
    rows, cols = np.nonzero(mask)
    n = min(max(cfg.tokens, Embeddings.ROWS), rows.size)
    pick = np.sort(ridge_rng(cfg.seed, draw).choice(rows.size, size=n, replace=False))
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
FULL_PRODUCTS_MAX_BYTES = 1 << 30  # n x n inner products kept whole up to n = 11,585 (float64)


def inner_products(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """K = X X^T (n x n), computing only blocks on and above the diagonal and mirroring them."""
    n = x.shape[0]
    products = torch.empty(n, n, dtype=x.dtype, device=x.device)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        block = x[start:stop] @ x[start:].T
        products[start:stop, start:] = block
        products[stop:, start:stop] = block[:, stop - start :].T
    return products


def nearest_from_products(rows: torch.Tensor, sq: torch.Tensor, k: int, start: int) -> torch.Tensor:
    """Indices of the k nearest points for the points start.. whose inner products with all points are
    `rows`; |x_i - x_j|^2 = |x_i|^2 + |x_j|^2 - 2 x_i.x_j. Each point comes first in its own list."""
    ranking = torch.add(sq, rows, alpha=-2.0)  # |x_i|^2 is the same along a row: ranks unchanged
    own = torch.arange(rows.shape[0], device=rows.device)
    ranking[own, own + start] = -torch.inf  # despite rounding
    return torch.topk(ranking, k, dim=1, largest=False).indices


def grams_from_products(products: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Centered k x k Gram matrices J K[N_i, N_i] J (J = I - 11^T/k), gathered from the whole K."""
    n, k = products.shape[0], neighbours.shape[1]
    flat = (neighbours[:, :, None] * n + neighbours[:, None, :]).reshape(-1)
    gram = products.view(-1).index_select(0, flat).view(-1, k, k)
    row_mean = gram.mean(dim=2, keepdim=True)
    return gram - row_mean - row_mean.transpose(1, 2) + row_mean.mean(dim=1, keepdim=True)


def grams_from_points(x: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Centered k x k Gram matrices from the gathered neighbourhoods (when K does not fit)."""
    k = neighbours.shape[1]
    hood = torch.index_select(x, 0, neighbours.reshape(-1)).view(-1, k, x.shape[1])
    hood -= hood.mean(dim=1, keepdim=True)
    return torch.bmm(hood, hood.transpose(1, 2))


def local_lambda_max(
    x: torch.Tensor, k: int, chunk: int = 512, max_product_bytes: int = FULL_PRODUCTS_MAX_BYTES
) -> torch.Tensor:
    """lambda_max(C_i) for every point: the centered neighbourhood's k x k Gram matrix has the same
    nonzero spectrum as (k-1) C_i. Memory is O(n^2) while K fits in max_product_bytes, else
    O(chunk * (n + k * D)); blocks of points run on a thread pool (torch frees the GIL)."""
    x = x - x.mean(dim=0)  # distances and neighbourhood covariances are translation invariant
    n = x.shape[0]
    sq = x.pow(2).sum(dim=1)
    products = inner_products(x, chunk) if n * n * x.element_size() <= max_product_bytes else None

    def block(start: int) -> torch.Tensor:
        stop = min(start + chunk, n)
        rows = products[start:stop] if products is not None else x[start:stop] @ x.T
        neighbours = nearest_from_products(rows, sq, k, start)
        grams = grams_from_products(products, neighbours) if products is not None else grams_from_points(x, neighbours)
        return torch.linalg.eigvalsh(grams)[:, -1] / (k - 1)

    starts = range(0, n, chunk)
    if x.device.type != "cpu":
        return torch.cat([block(s) for s in starts])
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        return torch.cat(list(pool.map(block, starts)))


def local_curvature(x: torch.Tensor, k: int, chunk: int = 512) -> float:
    lam = local_lambda_max(x, k, chunk)
    # a neighbourhood of exact duplicates has lambda_max = 0; computed, it is 0 up to rounding of |x|^2
    rounding = k * torch.finfo(x.dtype).eps * float((x - x.mean(dim=0)).pow(2).sum(dim=1).max())
    positive = lam[lam > rounding]
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


def global_monotonicity(
    x: torch.Tensor, eig: torch.Tensor, vecs: torch.Tensor, eps_rel: float, pairs: tuple[np.ndarray, np.ndarray]
) -> float:
    """median (v^T P v)/(v^T v), P = (Sigma + eps I)^-1 = U diag(1/(lambda + eps)) U^T."""
    eps = eps_rel * float(eig.sum()) / x.shape[1]
    a, b = (torch.as_tensor(i, device=x.device) for i in pairs)
    w = x @ (vecs / torch.sqrt(eig + eps))  # v^T P v = |w_a - w_b|^2: whiten the n points once
    vv = (x[a] - x[b]).pow(2).sum(1)
    keep = vv > 0
    ratio = (w[a] - w[b]).pow(2).sum(1)[keep] / vv[keep]
    return float(np.median(ratio.cpu().numpy()))


def spectrum_stats(eig: torch.Tensor) -> dict[str, float]:
    eig = eig.clamp_min(0)
    total = float(eig.sum())
    p = eig / total if total > 0 else eig
    p = p[p > 0]
    return {
        "k_hat": total / float(eig[-1]) if float(eig[-1]) > 0 else float("nan"),
        "participation_ratio": total**2 / float((eig**2).sum()) if total > 0 else float("nan"),
        "entropy_rank": float(torch.exp(-(p * p.log()).sum())),
    }


class Geometry:
    """One layer's sampled states X (already normalized, float64), what the proxies read: the
    score's settings, the m_mono pairs, the spectrum of Sigma computed once for all, and the token
    embeddings with the layer's states at the ridge proxies' own positions (None without layer 0)."""

    def __init__(self, x: torch.Tensor, cfg: ScoreConfig, pairs, embeddings: Embeddings | None = None, targets=None):
        """targets: the layer's states at the embeddings' positions (Embeddings.ROWS of them); default x."""
        self.x, self.cfg, self.pairs, self.embeddings = x, cfg, pairs, embeddings
        self.targets = x if targets is None else targets
        self._ridge: dict[int, dict[str, float]] = {}

    @functools.cached_property
    def spectrum(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.linalg.eigh(covariance(self.x))  # Sigma = U diag(eig) U^T, eig ascending

    def ridge(self, width: int) -> dict[str, float]:
        """Embeddings.fit of this layer at one window width, once for its R^2 and its penalty."""
        if self.embeddings is None:
            return {"r2": float("nan"), "penalty": float("nan")}
        if width not in self._ridge:
            self._ridge[width] = self.embeddings.fit(self.targets, width)
        return self._ridge[width]


# the proxies of stages/registry.py's PROXIES, each a function of one layer's Geometry
def m_curv(g: Geometry) -> float:
    return local_curvature(g.x, g.cfg.k, g.cfg.chunk)


def m_mono(g: Geometry) -> float:
    return global_monotonicity(g.x, *g.spectrum, g.cfg.eps_rel, g.pairs)


def k_hat(g: Geometry) -> float:
    return spectrum_stats(g.spectrum[0])["k_hat"]


def participation_ratio(g: Geometry) -> float:
    return spectrum_stats(g.spectrum[0])["participation_ratio"]


def entropy_rank(g: Geometry) -> float:
    return spectrum_stats(g.spectrum[0])["entropy_rank"]


def r2_token(g: Geometry) -> float:
    return g.ridge(1)["r2"]


def r2_context(g: Geometry) -> float:
    return g.ridge(Embeddings.WINDOW)["r2"]


def r2_token_penalty(g: Geometry) -> float:
    return g.ridge(1)["penalty"]


def r2_context_penalty(g: Geometry) -> float:
    return g.ridge(Embeddings.WINDOW)["penalty"]


class RidgeBasis:
    """Ridge maps from features F_A to any targets Y, scored on F_B, at every penalty after one
    eigendecomposition: of the Gram F_A'F_A (p x p, primal) when there are at least as many rows as
    features, else of the kernel F_A F_A' (n_A x n_A, dual; at D = 4096 with --tokens 4096, 5,243 held-in
    rows for 16,385 window features). The prediction on F_B at penalty lam is Z_B diag(1 / (e + lam)) G,
    with G = V'(F_A'Y_A) and Z_B = F_B V (primal) or G = U'Y_A and Z_B = (F_B F_A') U (dual).

    The caller gives the Gram or kernel blocks, so that the folds take theirs from the whole's (a fold's
    Gram is the whole's minus its held-out rows'; its kernel blocks are the whole kernel's rows and
    columns) and every fit of a layer shares one F'Y (Embeddings.fit)."""

    def __init__(self, gram: torch.Tensor, to_b: torch.Tensor, primal: bool):
        """gram: F_A'F_A (primal) or F_A F_A' (dual), float64; to_b: F_B (primal) or F_B F_A' (dual)."""
        e, rotation = torch.linalg.eigh(gram)
        self.primal, self.e, self.rotation = primal, e.clamp_min(0), rotation.float()
        self.z_b = (to_b @ rotation).float()
        self.gram_b = (self.z_b.T @ self.z_b).double()  # Z_B'Z_B, for every target at once

    def g(self, y_a: torch.Tensor, cross_a: torch.Tensor | None) -> torch.Tensor:
        """G of the targets: V'(F_A'Y_A) from cross_a = F_A'Y_A (primal), else U'Y_A."""
        return self.rotation.T @ (cross_a if self.primal else y_a.float())

    def errors(self, y_b: torch.Tensor, g: torch.Tensor, lams: list[float]) -> np.ndarray:
        """|Y_B - Z_B diag(s) G|^2 at each penalty, s = 1 / (e + lam): |Y_B|^2 - 2 s.h + s'(Z_B'Z_B o GG')s,
        h_i = <(Z_B'Y_B)_i, G_i>, without forming a prediction; every penalty in one product."""
        h = ((self.z_b.T @ y_b.float()).double() * g.double()).sum(1)
        quad = self.gram_b * (g @ g.T).double()
        shrink = 1 / (self.e[:, None] + torch.tensor(lams, dtype=self.e.dtype, device=self.e.device))  # (p, L)
        total = float((y_b.double() ** 2).sum())
        return (total - 2 * (h @ shrink) + (shrink * (quad @ shrink)).sum(0)).clamp_min(0).cpu().numpy()

    def predict(self, g: torch.Tensor, lam: float) -> torch.Tensor:
        return self.z_b @ (g / (self.e + lam).float()[:, None])


class RidgeFolds:
    """The held-in rows' fit and its folds' fits (a RidgeBasis each) on one feature matrix F, every Gram
    from F'F and every kernel from F F': a fold's F_A'F_A is F'F - F_B'F_B, its F_A F_A' and F_B F_A' are
    blocks of F F'."""

    def __init__(self, f: torch.Tensor, test: torch.Tensor, folds: list[tuple[torch.Tensor, torch.Tensor]]):
        """f: the held-in rows' features (float64); test: the held-out rows'; folds: (A, B) row indices of f."""
        p = f.shape[1]
        self.f32, self.primal_any = f.float(), max(f.shape[0], *(len(a) for a, _ in folds)) >= p
        gram = f.T @ f if self.primal_any else None
        kernel = f @ f.T if min(f.shape[0], *(len(a) for a, _ in folds)) < p else None
        self.whole = RidgeBasis(gram, test, True) if f.shape[0] >= p else RidgeBasis(kernel, test @ f.T, False)
        self.folds = [
            RidgeBasis(gram - f[b].T @ f[b], f[b], True)
            if len(a) >= p
            else RidgeBasis(kernel[a][:, a], kernel[b][:, a], False)
            for a, b in folds
        ]

    def cross(self, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """F'Y over the rows given (y their targets), float32; None when no fit is primal."""
        return self.f32[rows].T @ y.float() if self.primal_any else None


class Embeddings:
    """dihal's own proxies of how far layer l still is from the embedding interface (METHOD §1,
    not the paper's): the held-out R^2 of the ridge map from the token embeddings h_0 to
    h_l, from the token alone (r2_token) and from a causal window of it and its WINDOW - 1
    predecessors (r2_context).

    Positions: max(--tokens, ROWS) of them, drawn apart from the geometry's. A ridge map's held-out R^2
    rises with the rows it is fitted on whatever its penalty (layer 1 of smollm2-135m, the best
    penalty in hindsight: 0.52 at 1,024 positions, 0.65 at 2,048, 0.74 at 4,096, 0.78 at 8,192), so
    --tokens, which sizes the geometry's O(n^2) neighbourhoods, does not size this O(n p^2) fit.

    A fifth of them is held out; the map is fitted on the rest at a penalty (x held-in rows) chosen on
    the held-in positions alone, by the rule `--r2-penalty`:
        kfold  FOLDS-fold cross-validation over random folds of the held-in rows. A fold, like the held-out
               fifth, holds a fifth of the rows, so its tokens are unseen by its fit in the proportion the
               held-out fifth's are, and memorising the seen ones pays exactly as much as it will there.
        gcv    generalized cross-validation (Golub, Heath and Wahba 1979), the rule before. It approximates
               leave-one-out, which never leaves a token out (at layer 1, h_l is nearly a function of the
               token, and frequent tokens repeat), so it rewarded memorising them: at 2,048 positions it took
               the grid's smallest penalty and scored -0.5 to -1.1, the held-out fifth's unseen tokens far off.
    For one draw of positions the split, the folds and every fit's eigenbasis (RidgeBasis) are made once,
    whatever the layer: each layer then costs a few matrix products."""

    WINDOW = 4
    HELD_OUT = 0.2
    FOLDS = 5
    ROWS = 8192
    PENALTIES = tuple(10.0 ** (k / 4) for k in range(-16, 9))  # 1e-4 .. 1e2, x held-in rows

    def __init__(
        self, window: np.ndarray, seed: int, draw: int, device: str = "cpu", rule: str = "kfold", widths=(1, WINDOW)
    ):
        n = window.shape[0]
        order = draw_rng(seed, draw).permutation(n)
        n_test = max(1, int(round(self.HELD_OUT * n)))
        self.test, self.train = (torch.from_numpy(np.sort(i)).to(device) for i in (order[:n_test], order[n_test:]))
        self.rule = rule
        x = torch.from_numpy(window).to(device, torch.float64)
        features = {w: self._features(x[:, :w].reshape(n, -1)) for w in widths}
        if rule == "gcv":
            self.bases = {w: self._gcv_basis(f) for w, f in features.items()}
            return
        fold = np.random.default_rng([seed, draw, 31]).permutation(len(self.train)) % self.FOLDS
        self.folds = [
            (
                torch.from_numpy(np.flatnonzero(fold != k)).to(device),
                torch.from_numpy(np.flatnonzero(fold == k)).to(device),
            )
            for k in range(self.FOLDS)
        ]
        self.fits = {w: RidgeFolds(f[self.train], f[self.test], self.folds) for w, f in features.items()}

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        """x normalized per dimension with held-in statistics, plus an intercept column."""
        mu, sd = x[self.train].mean(0), x[self.train].std(0).clamp_min(1e-6)
        return torch.cat([(x - mu) / sd, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)

    def _gcv_basis(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(eigenvalues e of F'F, held-in features F V, held-out features F_test V) of the held-in rows; the
        rotated features are float32: they enter only the two products per layer."""
        train, test = f[self.train], f[self.test]
        e, v = torch.linalg.eigh(train.T @ train)
        return e.clamp_min(0), (train @ v).float(), (test @ v).float()

    def _targets(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-in and held-out targets normalized per dimension with held-in statistics (as the bridge's)."""
        train, test = y[self.train], y[self.test]
        mu, sd = train.mean(0), train.std(0).clamp_min(1e-6)
        return (train - mu) / sd, (test - mu) / sd

    def fit(self, y: torch.Tensor, width: int) -> dict[str, float]:
        """The chosen penalty (x held-in rows) and the held-out R^2 = 1 - SSE / SST of its map."""
        if self.rule == "gcv":
            return self._fit_gcv(y, width)
        train, test = self._targets(y)
        fits = self.fits[width]
        held_out = [fits.cross(train[b], b) for _, b in self.folds]  # F_B'Y_B of each fold (None if all dual)
        whole = None if held_out[0] is None else sum(held_out)  # F'Y; a fold's F_A'Y_A is it minus its F_B'Y_B
        cv = np.zeros(len(self.PENALTIES))
        for (a, b), basis, cross_b in zip(self.folds, fits.folds, held_out):
            cross = None if whole is None else whole - cross_b
            cv += basis.errors(train[b], basis.g(train[a], cross), [k * len(a) for k in self.PENALTIES])
        penalty = self.PENALTIES[int(np.argmin(cv))]
        basis = fits.whole
        residual = test - basis.predict(basis.g(train, whole), penalty * len(self.train)).double()
        return {"r2": float(1 - (residual**2).sum() / (test**2).sum()), "penalty": penalty}

    def _fit_gcv(self, y: torch.Tensor, width: int) -> dict[str, float]:
        """GCV over PENALTIES x held-in rows. With Z = F V and G = Z'Y, the held-in fit at penalty lam has
        SSE = |Y|^2 - 2 sum g/(e+lam) + sum e g/(e+lam)^2 (g the squared row norms of G) and trace(H) =
        sum e/(e+lam), so every penalty is O(p)."""
        e, z_train, z_test = self.bases[width]
        train, test = self._targets(y)
        gram_y = z_train.T @ train.float()  # G = Z'Y, (p, D)
        g, total, n = (gram_y.double() ** 2).sum(1), float((train**2).sum()), len(self.train)

        def gcv(lam: float) -> float:
            shrink = 1 / (e + lam)
            sse = total - 2 * float((g * shrink).sum()) + float((e * g * shrink**2).sum())
            dof = float((e * shrink).sum())
            return max(sse, 0.0) / (n * (1 - dof / n) ** 2) if dof < n else float("inf")

        penalty = min(self.PENALTIES, key=lambda k: gcv(k * n))
        coef = gram_y / (e + penalty * n).float()[:, None]
        residual = test - (z_test @ coef).double()
        return {"r2": float(1 - (residual**2).sum() / (test**2).sum()), "penalty": penalty}

    @classmethod
    def for_draws(cls, group, positions: list, seed: int, device: str = "cpu", rule: str = "kfold") -> list:
        """One per draw of (sequences, positions), from the extract's layer 0 (None each without it): h_0 at
        p, p-1, ..., p-WINDOW+1, zeros before position 0. Only those positions are read, once for all draws
        (whole sequences would be every chunk of a paper-sized extract: 20 GiB at 20,000 x 128 x 4096)."""
        if 0 not in hs.stored_layers(group):
            return [None] * len(positions)
        wanted = [
            (seqs[ok], pos[ok] - j) for seqs, pos in positions for j in range(cls.WINDOW) if (ok := pos >= j).any()
        ]
        length = group["input_ids"].shape[1]
        keys = np.unique(np.concatenate([s.astype(np.int64) * length + p for s, p in wanted]))
        states = hs.read_positions(group, 0, keys // length, keys % length)  # (K, D), position 0 exact
        out = []
        for draw, (seqs, pos) in enumerate(positions):
            window = np.zeros((len(seqs), cls.WINDOW, states.shape[1]))
            for j in range(cls.WINDOW):
                ok = pos - j >= 0
                window[ok, j] = states[np.searchsorted(keys, seqs[ok].astype(np.int64) * length + pos[ok] - j)]
            out.append(cls(window, seed, draw, device, rule=rule))
        return out


def layer_proxies(
    x: torch.Tensor, cfg: ScoreConfig, pairs, embeddings=None, proxies=None, targets=None
) -> dict[str, float]:
    """The registered proxies of one layer (every one, or those named), X already normalized, float64."""
    g = Geometry(x, cfg, pairs, embeddings, targets)
    chosen = [registry.PROXIES[name] for name in proxies] if proxies else registry.proxy_set(cfg.proxies).values()
    return {p.name: registry.resolve(p.fn)(g) for p in chosen}


def inliers(raw: torch.Tensor, mads: float) -> torch.Tensor:
    """Positions whose norm is at most median + mads * 1.4826 * MAD (all of them when MAD = 0)."""
    norms = raw.norm(dim=1)
    median = norms.median()
    mad = (norms - median).abs().median()
    if float(mad) == 0:
        return torch.ones_like(norms, dtype=torch.bool)
    return norms <= median + mads * 1.4826 * mad


def layer_row(raw: torch.Tensor, cfg: ScoreConfig, pairs, embeddings=None, targets=None) -> dict[str, float]:
    """The proxies of one layer's raw states (float64), and with --outlier-mads the robust ones; targets:
    its states at the ridge proxies' positions (default raw: the same positions)."""
    row = layer_proxies(normalize(raw, cfg.normalize), cfg, pairs, embeddings, targets=targets)
    row["mean_token_norm"] = float(raw.norm(dim=1).mean())
    if cfg.outlier_mads is not None:
        keep = inliers(raw, cfg.outlier_mads)
        kept = int(keep.sum())
        if kept <= cfg.k:
            raise DihalError(f"--outlier-mads {cfg.outlier_mads} leaves {kept} positions, not more than --k; raise it")
        terms = [p.name for p in registry.score_terms()]
        robust = layer_proxies(
            normalize(raw[keep], cfg.normalize), cfg, sample_pairs(kept, cfg.pairs, cfg.seed), None, terms
        )
        row.update({f"{p.name}_robust": robust[p.name] for p in registry.score_terms()})
        row["n_outliers"] = raw.shape[0] - kept
    return row


# -- the combined score -----------------------------------------------------------------------
def zscore(values: pd.Series) -> pd.Series:
    std = values.std(ddof=0)
    if not np.isfinite(std) or std == 0:
        return pd.Series(0.0, index=values.index)
    return (values - values.mean()) / std


def combine(table: pd.DataFrame) -> pd.DataFrame:
    """Adds z_<proxy> of every term of S, S = sum of sign x z, and rank (1 = best) to a per-layer
    proxy table, and the same with the suffix _robust where the robust proxies are there."""
    out, terms = table.copy(), registry.score_terms()
    for suffix in ("", "_robust") if f"{terms[0].name}_robust" in out else ("",):
        for p in terms:
            out[f"z_{p.name}{suffix}"] = zscore(out[f"{p.name}{suffix}"])
        out[f"S{suffix}"] = sum(p.sign * out[f"z_{p.name}{suffix}"] for p in terms)
        out[f"rank{suffix}"] = out[f"S{suffix}"].rank(ascending=False, method="first").astype(int)
    return out.sort_values("layer").reset_index(drop=True)


def stability(table: pd.DataFrame, draws: pd.DataFrame) -> pd.DataFrame:
    """Per layer over the bootstrap draws: mean, std and 95% interval of S, the rank range, and the
    fraction of draws in which the layer is l* (and of S_robust where it is there)."""
    out = table.set_index("layer")
    for suffix in ("", "_robust") if "S_robust" in draws else ("",):
        by_layer = draws.groupby("layer")[f"S{suffix}"]
        out[f"S{suffix}_boot_mean"], out[f"S{suffix}_boot_std"] = by_layer.mean(), by_layer.std(ddof=1)
        ci = [bootstrap.interval(out.loc[layer, f"S{suffix}"], g) for layer, g in by_layer]  # contains S
        out[f"S{suffix}_boot_lo"] = pd.Series([c["lo"] for c in ci], index=[layer for layer, _ in by_layer])
        out[f"S{suffix}_boot_hi"] = pd.Series([c["hi"] for c in ci], index=[layer for layer, _ in by_layer])
        ranks = draws.groupby("layer")[f"rank{suffix}"]
        out[f"rank{suffix}_min"], out[f"rank{suffix}_max"] = ranks.min(), ranks.max()
        winners = draws.loc[draws.groupby("draw")[f"S{suffix}"].idxmax(), "layer"]
        out[f"l_star{suffix}_freq"] = winners.value_counts().reindex(out.index, fill_value=0) / draws["draw"].nunique()
    return out.reset_index()


# -- the stage ----------------------------------------------------------------------------------
def parse_candidates(spec: str | None, stored: list[int], num_blocks: int) -> list[int]:
    from dihal.stages.extract import parse_layers

    layers = list(range(1, num_blocks)) if spec is None else parse_layers(spec, num_blocks)
    missing = [l for l in layers if l not in stored]
    if missing:
        raise DihalError(
            f"candidate layer {missing[0]} is not in the extract (it holds {_ranges(stored)}); "
            "pass --candidates within those or extract the layer"
        )
    if len(layers) < 2:
        raise DihalError("--candidates needs at least two layers to z-score across")
    return layers


def _ranges(layers: list[int]) -> str:
    if not layers:
        return "no layer: token ids alone, --layers none"
    return (
        f"layers {layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else f"layers {layers}"
    )


def uses_pool(group, cfg: ScoreConfig) -> bool:
    """The extract's pool is a uniform sample of the train split's positions >= 1; a score of that
    kind no larger than the pool draws from it (a uniform subsample of a uniform sample)."""
    exclude = excluded_positions(cfg.exclude_positions)
    return (
        "sample_seq" in group
        and cfg.split == "train"
        and exclude == [0]
        and cfg.tokens <= int(group.attrs.get("sample_pool", 0))
    )


def score_layers(
    group, cfg: ScoreConfig, layers: list[int], progress: Progress
) -> tuple[pd.DataFrame, pd.DataFrame | None, np.ndarray, np.ndarray]:
    """(the score's table, the bootstrap draws' long table or None, the sampled positions' sequences and
    token positions)."""
    exclude = excluded_positions(cfg.exclude_positions)
    draws = range(1 + cfg.bootstrap)
    # r2_token and r2_context at positions of their own; under gcv, the rule of before, at the geometry's (its ids)
    fits = any(p.embeddings for p in registry.proxy_set(cfg.proxies).values())
    ridge = fits and cfg.r2_penalty != "gcv"
    if uses_pool(group, cfg):  # the extract's pool: O(pool x D) read per layer
        pool_seq, pool_pos, _ = hs.read_pool(group, layers[0])
        picks = [np.sort(draw_rng(cfg.seed, d).choice(pool_seq.size, size=cfg.tokens, replace=False)) for d in draws]
        rows_r2 = min(max(cfg.tokens, Embeddings.ROWS), pool_seq.size)
        ridge_picks = [np.sort(ridge_rng(cfg.seed, d).choice(pool_seq.size, rows_r2, replace=False)) for d in draws]
        positions = [(pool_seq[p], pool_pos[p]) for p in picks]
        ridge_positions = [(pool_seq[p], pool_pos[p]) for p in ridge_picks]

        def read_layer(layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
            states = hs.read_pool(group, layer)[2]
            return [(states[p], states[q] if ridge else None) for p, q in zip(picks, ridge_picks)]

    else:  # reads the chunks that hold the sampled positions
        positions = [sample_positions(group, cfg.split, cfg.tokens, exclude, cfg.seed, d) for d in draws]
        ridge_positions = [ridge_sample(group, cfg, exclude, d) for d in draws]

        def read_layer(layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
            return [
                (hs.read_positions(group, layer, s, p), hs.read_positions(group, layer, rs, rp) if ridge else None)
                for (s, p), (rs, rp) in zip(positions, ridge_positions)
            ]

    pairs = sample_pairs(cfg.tokens, cfg.pairs, cfg.seed)
    embeddings = [None] * len(positions)
    if fits:
        at = ridge_positions if ridge else positions
        embeddings = Embeddings.for_draws(group, at, cfg.seed, cfg.device, cfg.r2_penalty)
    rows = []
    progress.start("score", len(layers) * len(draws), "layer x draw" if cfg.bootstrap else "layer")
    with ThreadPoolExecutor(max_workers=1) as reader:  # reads layer l+1 while layer l is scored

        def read(layer: int):
            return reader.submit(read_layer, layer)

        pending = read(layers[0])
        for position, layer in enumerate(layers):
            per_draw = pending.result()
            if position + 1 < len(layers):
                pending = read(layers[position + 1])
            for draw, (states, ridge_states) in enumerate(per_draw):
                raw = torch.from_numpy(states).to(cfg.device, torch.float64)
                targets = None if ridge_states is None else torch.from_numpy(ridge_states).to(cfg.device, torch.float64)
                rows.append({"draw": draw, "layer": layer, **layer_row(raw, cfg, pairs, embeddings[draw], targets)})
                progress.advance(1)
    progress.stop()
    long = pd.DataFrame(rows)
    scored = pd.concat([combine(g).assign(draw=d) for d, g in long.groupby("draw")], ignore_index=True)
    table = scored[scored["draw"] == 0].drop(columns="draw").reset_index(drop=True)
    boot = scored[scored["draw"] > 0].reset_index(drop=True) if cfg.bootstrap else None
    if boot is not None:
        table = stability(table, boot)
    return table, boot, *positions[0]


def config_dict(cfg: ScoreConfig, layers: list[int]) -> dict:
    """What a score's id hashes: its config, the candidates resolved, the proxies computed (their columns:
    a score made before r2_token and r2_context were registered, or of --proxies paper, has others) and,
    with the ridge proxies, the penalty grid and the k-fold rule they choose by."""
    chosen = registry.proxy_set(cfg.proxies)
    config = {**cfg.hashed(), "candidates": layers, "device": None, "proxies": list(chosen)}
    if any(p.embeddings for p in chosen.values()):
        config["r2_penalties"] = [float(f"{k:.6g}") for k in Embeddings.PENALTIES]
        if cfg.r2_penalty == "kfold":
            config["r2_folds"], config["r2_rows"] = Embeddings.FOLDS, Embeddings.ROWS
    else:
        config.pop("r2_penalty", None)  # no ridge fit to choose a penalty for
    return config


def run(
    cfg: ScoreConfig, extract: Artifact, store: ArtifactStore, *, force: bool = False, progress: Progress | None = None
) -> Artifact:
    progress = progress or NullProgress()
    keep_freed_memory()  # first, before zarr or a progress bar start threads; see stages/runtime/allocator.py
    group = hs.open_group(extract)
    num_blocks = int(group.attrs["num_blocks"])
    if hs.pool_only(group) and not uses_pool(group, cfg):
        raise DihalError(
            f"extract {extract.id} holds its layers at the score's pool of {group.attrs.get('sample_pool', 0)} "
            "positions alone (--keep pool); score from it (--tokens at most that, --split train, "
            "--exclude-positions 0) or extract with --keep layers"
        )
    held = hs.pooled_layers(group) if hs.pool_only(group) else hs.stored_layers(group)
    layers = parse_candidates(cfg.candidates, held, num_blocks)
    config, parents = config_dict(cfg, layers), {"extract": extract.id}

    def work(art: Artifact) -> None:
        table, boot, seq_idx, pos_idx = score_layers(group, cfg, layers, progress)
        chosen = picks(table)
        write_outputs(art, table, seq_idx, pos_idx, chosen, cfg.select)
        if boot is not None:
            boot.to_csv(art.file("bootstrap.csv"), index=False)
        metrics = {
            "l_star": chosen[cfg.select],  # what compare and the main job use (--select)
            "select": cfg.select,
            **{f"l_star_{name}": layer for name, layer in chosen.items()},
            "n_tokens": cfg.tokens,
            "candidates": layers,
            "positions_from": "extract pool" if uses_pool(group, cfg) else "layers",
            "r2": {  # how r2_token and r2_context were fitted
                "window": Embeddings.WINDOW,
                "held_out": Embeddings.HELD_OUT,
                "ridge_penalty": (
                    f"chosen per layer on the held-in rows by {Embeddings.FOLDS}-fold cross-validation over "
                    "random folds (columns r2_*_penalty, x rows)"
                    if cfg.r2_penalty == "kfold"
                    else "chosen per layer by GCV on the held-in rows (columns r2_*_penalty, x rows)"
                ),
                "rule": cfg.r2_penalty,
                "penalty_grid": list(Embeddings.PENALTIES),
            },
        }
        for suffix in ("", "_robust") if "S_robust" in table else ("",):
            winner = int(table.loc[table[f"S{suffix}"].idxmax(), "layer"])
            if suffix:
                metrics[f"l_star{suffix}"] = winner
            if boot is not None:  # how often argmax S is this layer over the draws
                freq = table.set_index("layer")[f"l_star{suffix}_freq"]
                metrics[f"l_star{suffix}_frequency"] = float(freq[winner])
        art.manifest["metrics"] = metrics

    extra = {"model": extract.manifest.get("model")}
    job = Job(STAGE, CACHE_VERSION, config, parents, work, seed=cfg.seed, device=cfg.device, extra=extra)
    return store.run_stage(job, force=force, progress=progress, group=dist.group())


def picks(table: pd.DataFrame) -> dict[str, int]:
    """The layer each selection rule picks: argmax S (the paper's l*) and argmax r2_token (dihal's)."""
    out = {"S": int(table.loc[table["S"].idxmax(), "layer"])}
    if "r2_token" in table and table["r2_token"].notna().any():
        out["r2_token"] = int(table.loc[table["r2_token"].idxmax(), "layer"])
    return out


def write_outputs(art: Artifact, table: pd.DataFrame, seq_idx, pos_idx, chosen: dict[str, int], select: str) -> None:
    table.to_parquet(art.file("table.parquet"), index=False)
    table.to_csv(art.file("table.csv"), index=False)
    summary = {
        "l_star": chosen[select],
        "select": select,
        **{f"l_star_{name}": layer for name, layer in chosen.items()},
        "S": float(table.set_index("layer").loc[chosen["S"], "S"]),
        "ranking": table.sort_values("rank")["layer"].astype(int).tolist(),
    }
    art.file("scores.json").write_text(json.dumps(summary, indent=2))
    np.savez(art.file("positions.npz"), sequence=seq_idx, position=pos_idx)
    plot(table, chosen, art.file("scores.png"), art.config.get("normalize", "none"))


def plot(table: pd.DataFrame, chosen: dict[str, int], path, normalize_mode: str) -> None:
    fig, ax = plotting.figure()
    for p in registry.score_terms():
        ax.plot(table["layer"], table[f"z_{p.name}"], marker=".", label=f"z({p.name})", alpha=0.8)
    ax.plot(table["layer"], table["S"], marker="o", color="black", linewidth=2, label="S")
    ax.axvline(chosen["S"], color="red", linestyle="--", label=f"l* = {chosen['S']} (argmax S)")
    if "r2_token" in chosen:
        ax.axvline(
            chosen["r2_token"], color="tab:green", linestyle=":", label=f"argmax r2_token = {chosen['r2_token']}"
        )
    ax.set_xlabel("layer")
    ax.set_ylabel("z-score")
    ax.legend()
    plotting.save(fig, ax, path, f"DiHAL geometry score (normalize={normalize_mode})")


def load_table(art: Artifact) -> pd.DataFrame:
    return pd.read_parquet(art.file("table.parquet"))

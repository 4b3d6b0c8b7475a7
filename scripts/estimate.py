"""What each stage of a paper-scale run will take: disk, RAM, peak GPU memory and time, for
Llama-3.1-8B-Instruct and Qwen3-8B (or a model of other shapes), printed before the run starts
(scripts/reproduce_paper.sh calls it).

Sizes follow from the model's shapes (scripts/make_random_model.py holds both published configs)
and the paper protocol (stages/configs.py PROTOCOLS["paper"]): bfloat16 weights, the float32 copy
of the LM head that fidelity and Gen.PPL use, the denoiser's weights, AdamW state and EMA, the
decoder's frozen V x D table and its training logits. The validation logits of the decoder and the
autoencoder come in 64 MiB slices, so they are left out. Times assume the throughputs in the footer;
those are assumptions until scripts/gpu_smoke.sh has measured them on a GPU (docs/results/paper_scale.md).

    python scripts/estimate.py                       # both 8B models
    python scripts/estimate.py --like qwen3-8b --sequences 40000
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_random_model import LIKE  # noqa: E402

from dihal.artifacts.hidden_states import estimate_bytes  # noqa: E402
from dihal.stages.configs import PROTOCOLS, CompareConfig  # noqa: E402
from dihal.stages.runtime.dist import deal  # noqa: E402
from dihal.stages.score import Embeddings  # noqa: E402

GIB = 2**30
PAPER = PROTOCOLS["paper"]
L_STAR = 3  # the paper's l* on Llama-3.1-8B: where a bridge's h_l is computed from, in the estimate


def shapes(a: argparse.Namespace) -> dict:
    """blocks, width, vocab, intermediate, kv width and parameters of the model."""
    c = {**LIKE[a.like]} if a.like else {}
    blocks, width = a.blocks or c["num_hidden_layers"], a.width or c["hidden_size"]
    vocab, inter = a.vocab or c["vocab_size"], a.intermediate or c["intermediate_size"]
    heads, kv = c.get("num_attention_heads", 32), c.get("num_key_value_heads", 8)
    head_dim = c.get("head_dim") or width // heads
    per_block = width * heads * head_dim * 2 + 2 * width * kv * head_dim + 3 * width * inter
    params = a.params or (2 * vocab * width + blocks * per_block)
    return dict(blocks=blocks, width=width, vocab=vocab, inter=inter, kv=kv * head_dim, params=params)


def denoiser_parameters(width: int, dim: int, depth: int, skip: bool = True) -> int:
    """Blocks (attention 4 w^2, MLP 8 w^2, adaLN 6 w^2), the timestep MLP and final adaLN (3 w^2), the
    input and output projections, the skip A c."""
    return (18 * depth + 3) * width**2 + 3 * dim * width + (dim * dim if skip else 0)


def training_gib(params: int, batch: int, tokens: int, width: int, depth: int, dim: int) -> float:
    """A part under the loop: float32 weights, gradients, two AdamW moments and the EMA (5 copies), the
    batch's tensors at D (x_t, c, y, eps, the output and their gradients), and bf16 activations."""
    state = 5 * 4 * params
    io = 8 * batch * tokens * dim * 4
    activations = 24 * batch * tokens * width * depth * 2
    return (state + io + activations) / GIB


def score_host_bytes(width: int, tokens: int, pool: int, base: float = 0.5 * GIB) -> float:
    """Host memory of `dihal score` at its peak: the larger of its two phases, from what each holds.
    Making the ridge fits (stages/score.py Embeddings, once): the windows of h_0 at max(tokens, ROWS)
    positions and the states read for them, both widths' features (float64), the fits made so far, and
    the largest temporary of one (the whole Gram F'F or kernel F F' its folds share, one
    eigendecomposition's workspace, the scored rows in its basis). Scoring the layers: the fits (each a
    float32 eigenbasis, p x p (primal) when its held-in rows are at least the features p, else the n x n
    kernel's, the scored rows in it and their float64 Gram; the held-in fit and FOLDS fold fits of the
    token and of the window) and the held-in rows' float32 features, beside the geometry's pairwise
    distances, a layer's targets and the pool's positions. And the process itself (base). Measured
    against this: tests/test_paper_script.py."""
    n = max(tokens, Embeddings.ROWS)
    held_out = max(1, round(Embeddings.HELD_OUT * n))
    train, folds = n - held_out, Embeddings.FOLDS
    fold_train, fold_test = train - train // folds, train // folds
    fits = features = temporary = 0.0
    for w in (1, Embeddings.WINDOW):
        p = w * width + 1
        features += n * p * 8
        fits += train * p * 4  # RidgeFolds.f32
        shared = (p * p * 8 if train >= p else 0) + (train * train * 8 if fold_train < p else 0)
        for rows, scored, copies in ((train, held_out, 1), (fold_train, fold_test, folds)):
            m = min(rows, p)  # the eigenbasis: p x p (primal) or rows x rows (the kernel's)
            fits += copies * (m * m * 4 + scored * m * 4 + m * m * 8 + m * 8)
            temporary = max(temporary, shared + 3 * m * m * 8 + scored * m * 8)
    making = n * Embeddings.WINDOW * width * 8 + 3 * n * width * 8 + features + fits + temporary
    scoring = fits + 6 * tokens**2 * 8 + 4 * tokens * width * 8 + 2 * pool * width * 8 + 2 * n * width * 8
    return base + max(making, scoring)


def compare_parts(seeds: int, budgets: list[int]) -> tuple[int, float]:
    """(parts per seed and budget, epochs in all) of the script's comparison: every row's distinct part once
    (stages/compare.py part_configs, every row but the oracle's), each budget k training k epochs."""
    from dihal.stages.compare import part_configs

    cfg = CompareConfig(protocol="paper", seeds=tuple(range(seeds)), budgets=tuple(budgets))
    parts = len(part_configs(cfg, 0, 1, 2))
    return parts, parts * seeds * sum(budgets)


def compare_layers(blocks: int) -> list[int]:
    """The layers of the script's comparison's parts over h_l, l >= 1 (bridges, DiHAL-direct's prior, the
    autoencoder's last layer) per seed and budget, at the paper's l* (L_STAR) and argmin S taken as the deepest
    candidate: the parts whose states cost blocks of the backbone (layer 0's cost only its embedding)."""
    from dihal.stages.compare import part_configs

    cfg = CompareConfig(protocol="paper", states="model")
    configs = part_configs(cfg, 0, L_STAR, blocks - 1).values()
    # the autoencoder's h_L is every block's output
    layers = [blocks if s.stage == "autoencoder" else getattr(c, "layer", 0) for s, _, c in configs]
    return [layer for layer in layers if layer >= 1]


def compare_generations() -> int:
    """Generations per seed and budget of the script's comparison (stages/compare.py generations): every row's
    at each of its temperatures, the controls', and the AR references'."""
    from dihal.stages.compare import generations

    cfg = CompareConfig(
        protocol="paper", temperatures=(0.0, 0.7, 1.0), controls=("sed", "codar", "dihal", "dihal-direct")
    )
    return len(generations(cfg))


RANK0 = "; rank 0 alone"  # a stage that does not split itself under torchrun


def estimate(a: argparse.Namespace) -> list[tuple[str, float, float, float, float, str]]:
    """(stage, disk GiB, RAM GiB, peak GPU GiB, minutes, note) per stage."""
    s, n = shapes(a), a.gpus
    d, v, layers, tokens = s["width"], s["vocab"], s["blocks"] + 1, a.sequences * a.seq_len
    weights = s["params"] * 2 / GIB  # bfloat16
    head32 = v * d * 4 / GIB  # the float32 LM head of fidelity and Gen.PPL
    n_train = int(a.sequences * (1 - a.val_fraction))
    w, depth, batch = PAPER["width"], PAPER["depth"], PAPER["batch_size"]
    computed = a.states == "model"  # h_l from the backbone's first l blocks (reproduce_paper.sh's default)
    # seconds of the first `layer` blocks over the training sequences, `passes` times, on one GPU
    forward = lambda layer, passes: passes * n_train * a.seq_len * layer / s["blocks"] / a.forward_tps
    captured = layers * a.batch * a.seq_len * d * 2 / GIB  # every layer of one batch, held until copied out
    if computed:  # the score's extract (--keep pool: layer 0 whole, the others at the pool), the token ids of all
        scored = score_extract_bytes(a, d, layers)
        ids = estimate_bytes(a.sequences, a.seq_len, d, [], a.batch, 0, a.val_fraction)
        extract_bytes, passed = scored + ids, a.score_sequences * a.seq_len
        held = f"{layers} layers x {a.pool:,} positions + h_0 x {passed:,} tokens, float16; token ids x {tokens:,}"
    else:
        extract_bytes = estimate_bytes(a.sequences, a.seq_len, d, ["float16"] * layers, a.batch, a.pool, a.val_fraction)
        passed, held = tokens, f"{layers} layers x {tokens:,} tokens, float16"
    rows = [
        (
            "extract",
            extract_bytes / GIB,
            captured * 4 + 2,
            weights + captured + 4 * a.batch * a.seq_len * s["inter"] * 2 / GIB,
            max(passed / (a.forward_tps * n), extract_bytes / GIB / a.disk_gibps) / 60,  # ranks split documents
            held,
        ),
        (
            "score",
            0.01,
            score_host_bytes(d, a.tokens, a.pool) / GIB,
            (a.tokens**2 * 8 * 4 + a.tokens * 4 * d * 8) / GIB,
            (a.pool * d * 2 * (layers - 2) / GIB / a.disk_gibps + (layers - 2) * a.score_s_per_layer) / 60,
            f"the {a.pool:,}-position pool and {max(a.tokens, Embeddings.ROWS):,} ridge rows" + RANK0,
        ),
    ]
    den = denoiser_parameters(w, d, depth)
    steps = math.ceil(n_train / batch)
    bridge_tokens = steps * batch * (a.seq_len - 1)
    # the normalizer's pass and one epoch of layer l alone (h_0 comes from the token ids, issue 64); none computed
    read = 0.0 if computed else 2 * n_train * a.seq_len * d * 2 / GIB
    bridge_gpu = training_gib(den, batch, a.seq_len - 1, w, depth, d)
    # the measured rate already includes reads from the page cache, and the Loader reads the next block while the
    # current one trains: the slower of the two bounds, never their sum (issue 64 item 6)
    # under DDP on n GPUs the compute splits, and so do the reads (each rank its own chunks of a window); they share
    # one disk, so the disk still bounds them at the bytes of one pass
    # computed states: each rank runs the first l blocks over its own rows, twice (the normaliser's pass, the epoch)
    ddp_minutes = (
        max(bridge_tokens / (a.bridge_tps * n), read / a.disk_gibps) + forward(L_STAR, 2) * computed / n
    ) / 60
    one_gpu = bridge_tokens / a.bridge_tps / 60  # a unit trained by one GPU alone (sweep, confirm, compare)
    ram = a.window * a.seq_len * d * 2 * 2 / GIB + 16384 * d * 8 * 2 / GIB + 2
    # disk of trained parts: a complete one keeps what --keep-weights says (final+ema: 8 bytes a parameter; ema: 4;
    # ema-bfloat16: 2); one in training also its resume state (weights, EMA and AdamW's two moments: 16), one per GPU
    # at a time (training(): that part of a row's disk, gone when the stage ends)
    kept = lambda params, count, gpus: (count * params * KEPT[a.keep_weights] + training(params, count, gpus)) / GIB
    training = lambda params, count, gpus: min(gpus, count) * params * 16
    rows.append(
        (
            "train-bridge (one layer)",
            kept(den, 1, 1),
            ram,
            bridge_gpu,
            ddp_minutes,
            f"{den / 1e6:.0f}M-parameter denoiser, {steps} steps (1 epoch)"
            + (f", h_{L_STAR} computed" if computed else ""),
        )
    )
    swept = range(1, s["blocks"])  # a bridge per layer, dealt whole to the GPUs by dist.deal
    costs = [one_gpu + forward(layer, 2) * computed / 60 for layer in swept]
    owners = deal(costs, n)
    a.in_training = {"sweep": training(den, len(swept), n) / GIB}
    rows.append(
        (
            f"sweep ({len(swept)} bridges)",
            kept(den, len(swept), n),
            ram,
            bridge_gpu,
            max(
                max(sum(c for c, o in zip(costs, owners) if o == r) for r in range(n)),
                len(swept) * read / a.disk_gibps / 60,
            ),
            "bridges dealt over the GPUs, one each at a time" + ("; h_l computed" if computed else "; the disk shared"),
        )
    )
    prior = denoiser_parameters(w, d, depth, skip=False)
    rows.append(
        (
            "train-prior",
            kept(prior, 1, 1),
            ram,
            training_gib(prior, batch, a.seq_len - 1, w, depth, d),
            ddp_minutes,
            "the bridge's network, no condition",
        )
    )
    table = v * d * 4 / GIB  # the frozen embedding table, float32
    decoder = denoiser_parameters(w, d, 2, skip=False)
    logits = 3 * batch * (a.seq_len - 1) * v * 4 / GIB  # training logits, their softmax and gradient, float32
    decoder_gpu = max(weights + table, table + training_gib(decoder, batch, a.seq_len - 1, w, 2, d) + logits)
    rows.append(
        (
            "train-decoder / -autoencoder",
            kept(decoder, 1, 1),
            ram + table,
            decoder_gpu,
            ddp_minutes,
            f"frozen {v:,} x {d} table; the backbone is read once for it",
        )
    )
    rows.append(
        (
            "evaluate (fidelity)",
            0.01,
            4,
            weights + head32 + bridge_gpu / 4,
            a.eval_tokens / a.forward_tps / 60,
            "backbone, float32 head, bridge; logits in slices" + RANK0,
        )
    )
    kv_cache = 2 * s["blocks"] * a.gen_batch * a.seq_len * s["kv"] * 2 / GIB
    rows.append(
        (
            "generate (AR)",
            0.1,
            4,
            weights + kv_cache + den * 4 / GIB + a.gen_batch * v * 8 / GIB,
            a.samples * (a.seq_len - 1) / a.gen_tps / 60,
            f"{a.samples} samples of {a.seq_len - 1} tokens" + RANK0,
        )
    )
    rows.append(
        (
            "evaluate (Gen.PPL)",
            0.01,
            4,
            weights + head32 + 1,
            a.samples * a.seq_len / a.forward_tps / 60,
            "the evaluator, float32 head" + RANK0,
        )
    )
    budgets = [int(b) for b in a.budgets.split(",")]
    seeds = len(a.seeds.split(","))
    parts, epochs = compare_parts(seeds, budgets)
    over_hl = compare_layers(s["blocks"])  # the layers of its parts over h_l (l*, argmin S)
    gens = compare_generations()
    samples = seeds * len(budgets) * gens * a.compare_samples
    sampling = samples * a.prior_steps * (a.seq_len - 1) / (3 * a.bridge_tps)  # a forward is a third of a step
    scoring = 2 * samples * a.seq_len / a.forward_tps  # under the backbone and the evaluator
    # compare's units over n GPUs by its own rule (stages/runtime/dist.py deal): each part's training (cost: its
    # budget) on one GPU alone, then each generation with its scoring; the three layers its parts read (0, l*,
    # argmin S) stay in the page cache after their first read, so the disk does not bound it
    # a part over h_l computes it (--states model) before its first epoch and in each of its k
    costs = [
        k * one_gpu + forward(layer, 1 + k) * computed / 60 for k in budgets for _ in range(seeds) for layer in over_hl
    ] + [k * one_gpu for k in budgets for _ in range(seeds * (parts - len(over_hl)))]
    owners = deal(costs, n)
    longest = max(sum(c for c, o in zip(costs, owners) if o == r) for r in range(n))
    units = seeds * len(budgets) * gens
    a.in_training["compare"] = training(den, parts * seeds * len(budgets), n) / GIB
    rows.append(
        (
            "compare",
            kept(den, parts * seeds * len(budgets), n),  # every part of every seed and budget, as a bridge
            ram + table,
            2 * (weights + head32) + decoder_gpu - weights,
            longest + math.ceil(units / n) / units * (sampling + scoring) / 60,
            f"{parts} parts x {seeds} seeds x budgets {a.budgets} = {epochs} epochs; {samples:,} samples scored twice",
        )
    )
    return rows


def sources(a: argparse.Namespace, layer: int = 3) -> list[tuple[str, float, float, str]]:
    """(source of a bridge's h_l, disk GiB, minutes of one bridge on one GPU, what the disk holds) for each source
    of a bridge at `layer` (the paper's l* on Llama-3.1-8B): the store (an extract of every layer) and the
    backbone computing it (`train-bridge --states model`: its first `layer` blocks run over the training
    sequences twice, the normaliser's pass and the epoch, at the forward rate scaled by the blocks it runs)."""
    s = shapes(a)
    d, layers = s["width"], s["blocks"] + 1
    n_train = int(a.sequences * (1 - a.val_fraction))
    batch = PAPER["batch_size"]
    bridge_tokens = math.ceil(n_train / batch) * batch * (a.seq_len - 1)
    all_layers = estimate_bytes(a.sequences, a.seq_len, d, ["float16"] * layers, a.batch, a.pool, a.val_fraction)
    ids = estimate_bytes(a.sequences, a.seq_len, d, [], a.batch, 0, a.val_fraction)  # --layers none
    score = score_extract_bytes(a, d, layers)
    read = 2 * n_train * a.seq_len * d * 2 / GIB
    forward = 2 * n_train * a.seq_len * layer / s["blocks"] / a.forward_tps
    return [
        (
            "store",
            all_layers / GIB,
            max(bridge_tokens / a.bridge_tps, read / a.disk_gibps) / 60,
            f"every layer of {a.sequences:,} sequences",
        ),
        (
            "model (--states model)",
            (ids + score) / GIB,
            (bridge_tokens / a.bridge_tps + forward) / 60,
            f"the token ids of {a.sequences:,} sequences; for the score, layer 0 of {a.score_sequences:,} and "
            f"every layer at its {a.pool:,}-position pool (--keep pool; l* held on a twentieth of pydoc, argmin S "
            "did not: docs/results/paper_scale.md)",
        ),
    ]


KEPT = {"final+ema": 8, "ema": 4, "ema-bfloat16": 2}  # bytes a parameter of a complete part (--keep-weights)


def score_extract_bytes(a: argparse.Namespace, width: int, layers: int) -> int:
    """The score's extract under --states model: score_sequences sequences, --keep pool (layer 0 whole: the
    r2 proxies read the positions before each of theirs; every layer at the pool)."""
    return estimate_bytes(
        a.score_sequences, a.seq_len, width, ["float16"] * layers, a.batch, a.pool, a.val_fraction, whole=1
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--like", choices=sorted(LIKE), default=None, help="one model's shapes (default: both 8B)")
    for name in ("blocks", "width", "vocab", "intermediate"):
        p.add_argument(f"--{name}", type=int, default=None, help="instead of --like's")
    p.add_argument("--params", type=float, default=None)
    for name, value in dict(
        sequences=20000,
        score_sequences=1024,
        seq_len=128,
        val_fraction=0.1,
        batch=32,
        pool=16384,
        tokens=4096,
        window=512,
        samples=1000,
        gen_batch=50,
        seeds="0,1,2",
        budgets="1,5",
        compare_samples=256,
        prior_steps=50,
        eval_tokens=512 * 128 * 5,
        forward_tps=20000.0,
        disk_gibps=1.0,
        score_s_per_layer=2.0,
        bridge_tps=14500.0,  # measured: the paper bridge on one H200, bound by the host (docs/results/paper_scale.md)
        gen_tps=400.0,
    ).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--model", default="", help="a name for the header")
    p.add_argument("--gpus", default="1,8", help="GPU counts of one node to estimate, comma list (torchrun)")
    p.add_argument(
        "--states",
        choices=("model", "store"),
        default="model",
        help="h_l computed by the backbone (reproduce_paper.sh's STATES, its default) or read from an extract",
    )
    p.add_argument(
        "--keep-weights",
        choices=sorted(KEPT),
        default="ema-bfloat16",
        help="what a complete part keeps (reproduce_paper.sh's KEEP_WEIGHTS, its default)",
    )
    a = p.parse_args()
    counts = [int(g) for g in a.gpus.split(",")]
    for like in [a.like] if (a.like or a.blocks) else sorted(LIKE):
        a.like = like
        s = shapes(a)
        totals = {}
        for gpus in counts:
            a.gpus = gpus
            print(
                f"\nestimate for {a.model or like or 'the model'}: {s['blocks']} blocks, width {s['width']}, "
                f"vocab {s['vocab']:,}, {s['params'] / 1e9:.2f}B parameters; paper protocol, "
                + ("one GPU" if gpus == 1 else f"{gpus} GPUs of one node under torchrun")
                + f"; h_l {'computed (--states model)' if a.states == 'model' else 'read from the store'}"
            )
            print(f"{'stage':<30}{'disk GiB':>9}{'RAM GiB':>8}{'GPU GiB':>8}{'minutes':>8}  note")
            rows = estimate(a)
            for stage, disk, ram, gpu, minutes, note in rows:
                print(f"{stage:<30}{disk:>9.1f}{ram:>8.1f}{gpu:>8.1f}{minutes:>8.0f}  {note}")
            totals[gpus] = sum(r[4] for r in rows) - rows[2][4]
            # the node's disk at its fullest: the extracts, the sweep's complete bridges and the comparison's
            # complete parts, and the resume states of the stage with the most parts in training at once (the sweep
            # and the comparison run one after the other; the lone train-bridge / -prior / -decoder rows are parts
            # the sweep and the comparison make)
            done = sum(r[1] for r in rows if not r[0].startswith("train-")) - sum(a.in_training.values())
            disk = done + max(a.in_training.values())
            print(f"{'peak (the sweep counted once)':<30}{disk:>9.1f}{'':>16}{totals[gpus]:>8.0f}")
        if 1 in totals and len(totals) > 1:
            print(
                "\n"
                + "; ".join(f"{g} GPUs: {m / totals[1]:.2f} of one GPU's time" for g, m in totals.items() if g != 1)
            )
        a.gpus = ",".join(map(str, counts))
        print(f"\n{'bridge at 3, h_l read from':<30}{'disk GiB':>9}{'minutes':>8}  on the disk")
        for source, disk, minutes, held in sources(a):
            print(f"{source:<30}{disk:>9.1f}{minutes:>8.0f}  {held}")
    print(
        f"\nrates, each with where it was measured:\n"
        f"  bridge training {a.bridge_tps:,.0f} tok/s per GPU: one H200 (2026-12-04), host-bound, with the loader "
        "before issue 64 (the new one is not yet measured on a GPU; docs/results/paper_scale.md)\n"
        f"  forward {a.forward_tps:,.0f} tok/s: assumed, not yet measured on a GPU\n"
        f"  generation {a.gen_tps:,.0f} tok/s (batched): assumed; on the CPU the hybrid takes 1.2-1.3x the backbone's "
        "time per token (benchmarks/results/hybrid_generate.json)\n"
        f"  disk {a.disk_gibps} GiB/s: assumed"
    )


if __name__ == "__main__":
    main()

"""What each stage of a paper-scale run will take: disk, RAM, GPU memory and time, printed before
the run starts (scripts/reproduce_paper.sh calls it). Sizes follow from the model's shape and the
run's flags; times assume the throughputs stated in the table's footer, which are assumptions to
be replaced by measured ones, not measurements.

python scripts/estimate.py --blocks 32 --width 4096 --vocab 128256 --params 8.0e9
"""

from __future__ import annotations

import argparse
import math

from dihal.artifacts.hidden_states import estimate_bytes

GIB = 2**30


def estimate(a: argparse.Namespace) -> list[tuple[str, float, float, float, float, str]]:
    """(stage, disk GiB, RAM GiB, GPU GiB, minutes, note) per stage."""
    layers, tokens = a.blocks + 1, a.sequences * a.seq_len
    n_train = int(a.sequences * (1 - a.val_fraction))
    weights = a.params * 2 / GIB  # bfloat16
    per_layer = tokens * a.width * 2 / GIB  # float16 storage (auto may pick float32 for a layer: twice that)
    # the extract's own estimate (layers, position-0 arrays, ids, the score's pool), as its plan prints it
    extract_bytes = estimate_bytes(
        a.sequences, a.seq_len, a.width, ["float16"] * layers, a.batch, a.pool, a.val_fraction
    )
    rows = [
        (
            "extract",
            extract_bytes / GIB,
            a.batch * a.seq_len * a.width * layers * 4 / GIB * 2 + 2,
            weights + a.batch * a.seq_len * a.width * 4 * 40 / GIB,
            max(tokens / a.forward_tps, per_layer * layers / a.disk_gibps) / 60,
            f"{layers} layers x {tokens:,} tokens, float16",
        )
    ]
    rows.append(
        (
            "score",
            0.01,
            (a.tokens**2 * 8 * 3 + a.pool * a.width * 8) / GIB + 1,
            0,
            (a.pool * a.width * 2 * (layers - 2) / GIB / a.disk_gibps + (layers - 2) * a.score_s_per_layer) / 60,
            f"reads the {a.pool:,}-position pool, not the layers",
        )
    )
    den = 12 * a.den_depth * a.den_width**2 + 3 * a.width * a.den_width + a.width**2  # blocks, in/out, skip A
    steps = math.ceil(n_train / a.bridge_batch)
    bridge_tokens = steps * a.bridge_batch * (a.seq_len - 1)
    read = 2 * n_train * a.seq_len * a.width * 2 / GIB * 2  # the normalizer's pass and one epoch, layers 0 and l
    rows.append(
        (
            f"sweep ({a.blocks - 1} bridges)",
            (a.blocks - 1) * den * 4 * 4 / GIB,
            a.window * a.seq_len * a.width * 2 * 2 / GIB + 16384 * a.width * 8 * 2 / GIB + 2,
            den * 16 / GIB + a.bridge_batch * a.seq_len * a.den_width * a.den_depth * 40 / GIB,
            (a.blocks - 1) * (bridge_tokens / a.bridge_tps + read / a.disk_gibps) / 60,
            f"{den / 1e6:.0f}M-parameter denoiser, {steps} steps a layer (1 epoch)",
        )
    )
    rows.append(
        (
            "evaluate + generate",
            0.1,
            4,
            weights + a.gen_batch * a.seq_len * a.vocab * 4 / GIB / 4,
            (a.samples * (a.seq_len - 1) / a.gen_tps + a.eval_tokens / a.forward_tps) / 60,
            f"{a.samples} samples of {a.seq_len - 1} tokens",
        )
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in dict(
        blocks=32,
        width=4096,
        vocab=128256,
        params=8.0e9,
        sequences=20000,
        seq_len=128,
        val_fraction=0.1,
        batch=32,
        pool=16384,
        tokens=4096,
        bridge_batch=64,
        den_width=1024,
        den_depth=8,
        window=512,
        samples=1000,
        gen_batch=50,
        eval_tokens=512 * 128 * 5,
        forward_tps=20000.0,
        disk_gibps=1.0,
        score_s_per_layer=2.0,
        bridge_tps=150000.0,
        gen_tps=400.0,
    ).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--model", default="")
    a = p.parse_args()
    print(f"estimate for {a.model or 'the model'}: {a.blocks} blocks, width {a.width}, vocab {a.vocab:,}")
    print(f"{'stage':<22}{'disk GiB':>10}{'RAM GiB':>9}{'GPU GiB':>9}{'minutes':>9}  note")
    total = 0.0
    for stage, disk, ram, gpu, minutes, note in estimate(a):
        total += minutes
        print(f"{stage:<22}{disk:>10.1f}{ram:>9.1f}{gpu:>9.1f}{minutes:>9.0f}  {note}")
    print(f"{'total':<22}{'':>28}{total:>9.0f}")
    print(
        f"assumed: forward {a.forward_tps:,.0f} tok/s, bridge training {a.bridge_tps:,.0f} tok/s, generation "
        f"{a.gen_tps:,.0f} tok/s (batched), disk {a.disk_gibps} GiB/s; one GPU; replace with your measurements"
    )


if __name__ == "__main__":
    main()

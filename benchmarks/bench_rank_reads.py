"""What each DDP rank reads of the store in one epoch of the paper's bridge (issue 64 item 4), and what dealing
chunks costs in balance; from the trainer's own schedule, no data read.

The paper's shape: 18,000 training sequences of 128 x 4096 float16 (1 MiB a sequence), chunks of 32 sequences
(the paper script's --batch-size), shuffle windows of 512, global batches of 64, one epoch. A rank reads whole
chunks (zarr reads a chunk whole, and verifies it whole), so its bytes are those of the chunks its Loader's
blocks touch. For 1, 2, 4 and 8 ranks:

    strided    items r, r + W, ... of each global batch (the deal before, and --states model's today)
    by chunk   the k-th chunk of each window to rank k mod W, a rank's items those of its chunks
               (stages/diffusion/trainer.Loader for a task that reads stored layers)

and, by chunk, the busiest rank's items in a step over an even share (mean over the epoch's steps).

    python benchmarks/bench_rank_reads.py        # writes benchmarks/results/rank_reads.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save  # noqa: E402
from dihal.stages.diffusion.trainer import Loader, LoopConfig, Schedule  # noqa: E402

N, CHUNK, WINDOW, BATCH, SEQ_BYTES = 18000, 32, 512, 64, 128 * 4096 * 2


class Task:
    n_train, chunk = N, CHUNK

    def __init__(self, stored: bool):
        self.stored = stored


def chunks_read(schedule: Schedule, loader: Loader) -> int:
    """Distinct chunks the rank's blocks read over the epoch (a block is read once, its items' chunks whole)."""
    touched = set()
    for first in range(0, schedule.total, loader.block):
        steps = range(first, min(first + loader.block, schedule.total))
        items = np.unique(np.concatenate([loader.mine(s)[1] for s in steps]))
        touched |= {(first // loader.block, int(c)) for c in np.unique(items // CHUNK)}
    return len(touched)


def main() -> None:
    cfg = LoopConfig(
        steps=None,
        epochs=1,
        batch_size=BATCH,
        lr=1e-3,
        warmup=0,
        schedule="constant",
        ema=0.9,
        eval_every=1000,
        checkpoint_every=1000,
        shuffle_window=WINDOW,
    )
    schedule = Schedule(N, CHUNK, cfg)
    epoch_gib = N * SEQ_BYTES / 2**30
    rows = []
    for world in (1, 2, 4, 8):
        row = {"ranks": world}
        for name, stored in (("strided", False), ("by_chunk", True)):
            per_rank = []
            for rank in range(world):
                loader = Loader(Task(stored), schedule, rank, world, first_step=schedule.total)  # reads nothing
                per_rank.append(chunks_read(schedule, loader) * CHUNK * SEQ_BYTES / 2**30)
                loader.close()
            row[f"{name}_gib_per_rank"] = round(max(per_rank), 2)
            row[f"{name}_share_of_epoch"] = round(max(per_rank) / epoch_gib, 3)
        busiest = [np.bincount(schedule.owners(s, world), minlength=world).max() for s in range(schedule.total)]
        row["by_chunk_busiest_over_even"] = round(float(np.mean(busiest)) / (BATCH / world), 3)
        rows.append(row)
    save(
        "rank_reads",
        {
            "shape": {
                "train_sequences": N,
                "chunk": CHUNK,
                "window": WINDOW,
                "batch": BATCH,
                "epoch_gib": round(epoch_gib, 2),
            },
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()

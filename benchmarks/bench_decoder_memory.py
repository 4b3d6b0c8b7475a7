"""Peak memory of the decoder's validation, before and after its logits were sliced (issue 34).

Before, DecoderTask.validate built the (N, T-1, V) float32 logits of every validation sequence at
once, and log_softmax another of the same size: at the paper protocol's 512 x 127 x 128,256 that is
33 GB twice. Now 64 sequences go through at a time and their logits in 64 MiB slices
(stages/diffusion/cross_decoder.py teacher_forced). Each way runs in a fresh process; the figure is
how far its peak RSS grows during validation, after a warm-up forward.

python benchmarks/bench_decoder_memory.py      # writes benchmarks/results/decoder_memory.json
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCRIPT = """
import resource, sys
from pathlib import Path
import numpy as np, torch, torch.nn.functional as F
from dihal.artifacts import hidden_states as hs
from dihal.stages.configs import DecoderTrainConfig
from dihal.stages.train_decoder import DecoderTask
from dihal.stages.diffusion.cross_decoder import CrossDecoder, DecoderConfig
from dihal.stages.diffusion.normalizer import Normalizer
torch.set_num_threads(1)
torch.manual_seed(0)
path, n_val, t, vocab, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 16
n = n_val + 8
group = hs.create(Path(sys.argv[5]), [0], n, t, d, {0: "float32"}, 8, {})
group["layers/0"][:] = np.random.default_rng(0).normal(size=(n, t, d)).astype(np.float32)
group["input_ids"][:] = np.random.default_rng(1).integers(0, vocab, (n, t)).astype(np.int32)
group["split"][:] = np.r_[np.zeros(8), np.ones(n_val)].astype(np.int8)
cfg = DecoderTrainConfig.from_protocol("compare-cpu", width=16, heads=2, val_sequences=n_val)
norm = Normalizer(*(torch.zeros(d), torch.ones(d)) * 2, torch.zeros(d))
task = DecoderTask(group, cfg, norm)
net = CrossDecoder(DecoderConfig(vocab=vocab, dim=d, width=16, depth=1, heads=2, max_len=t - 1), torch.randn(vocab, d))
e, ids = task.condition(task.val["c"]), torch.from_numpy(task.val["ids"].astype(np.int64))
with torch.no_grad():
    net(ids[:8, :-1], e[:8])  # warm-up: every kernel and buffer of a forward allocated once
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    if path == "old":  # what validate did before: every sequence's logits at once
        loss = float(F.cross_entropy(net(ids[:, :-1], e).float().transpose(1, 2), ids[:, 1:]))
    else:
        loss = task.validate(net)
print(loss, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def measure(path: str, sequences: int, seq_len: int, vocab: int, store: Path) -> dict:
    """Validation of `sequences` x `seq_len` tokens at vocabulary `vocab` the old or the new way, in a
    fresh process: {loss, peak_growth_bytes}."""
    args = [sys.executable, "-c", SCRIPT, path, str(sequences), str(seq_len), str(vocab), str(store)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    loss, grew = proc.stdout.split()
    return {"loss": float(loss), "peak_growth_bytes": int(grew)}


def main() -> None:
    from benchmarks.common import save

    sequences, seq_len, vocab = 128, 128, 49152  # smollm2-135m's vocabulary: 3.2 GB of logits the old way
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in ("old", "new"):
            m = measure(path, sequences, seq_len, vocab, Path(tmp) / path)
            rows.append({"path": path, "loss": m["loss"], "peak_growth_mib": round(m["peak_growth_bytes"] / 2**20)})
    save(
        "decoder_memory",
        {
            "shapes": f"{sequences} validation sequences x {seq_len - 1} tokens, vocabulary {vocab:,}",
            "logits_mib": round(sequences * (seq_len - 1) * vocab * 4 / 2**20),
            "rows": rows,
            "ratio": round(rows[0]["peak_growth_mib"] / max(rows[1]["peak_growth_mib"], 1), 1),
        },
    )


if __name__ == "__main__":
    main()

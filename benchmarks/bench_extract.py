"""Extraction throughput against a bare forward, and peak memory at three sizes (issue 2).

python benchmarks/bench_extract.py            # writes benchmarks/results/extract.json
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, peak_rss_mib, save  # noqa: E402
from dihal.artifacts.store import ArtifactStore  # noqa: E402
from dihal.stages import extract as ex  # noqa: E402
from dihal.stages.lm.models import load_model  # noqa: E402
from dihal.stages.text import data as data_mod  # noqa: E402

N_SEQ, SEQ_LEN, BATCH = 256, 64, 8


def bare_forward_tps(model, ids: np.ndarray) -> float:
    with torch.no_grad(), Timer() as t:
        for s in range(0, ids.shape[0], BATCH):
            model(
                input_ids=torch.from_numpy(ids[s : s + BATCH].astype(np.int64)),
                output_hidden_states=True,
                use_cache=False,
            )
    return ids.size / t.seconds


def extract_tps(loaded, layers: str, n_seq: int) -> float:
    cfg = ex.ExtractConfig(
        data=data_mod.DataConfig(max_sequences=n_seq, seq_len=SEQ_LEN), layers=layers, batch_size=BATCH
    )
    with tempfile.TemporaryDirectory() as tmp, Timer() as t:
        ex.run(cfg, ArtifactStore(tmp), loaded=loaded)
    return n_seq * SEQ_LEN / t.seconds


def memory_child(n_seq: int) -> None:
    loaded = load_model("smollm2-135m", "cpu", "float32")
    # the pydoc corpus imports stdlib modules as it goes, so more sequences import more of them:
    # read the whole corpus first, leaving only extraction's own memory to grow with the size
    sum(1 for _ in data_mod.documents(data_mod.DataConfig()))
    base = peak_rss_mib()
    extract_tps(loaded, "all", n_seq)
    print(f"{base} {peak_rss_mib()}")


def main() -> None:
    loaded = load_model("smollm2-135m", "cpu", "float32")
    ids = data_mod.pack(data_mod.DataConfig(seq_len=SEQ_LEN, max_sequences=N_SEQ), loaded.tokenizer).input_ids
    extract_tps(loaded, "0-4", 16)  # warm-up
    rows = {}
    for layers in ("all", "0-4"):
        bare = bare_forward_tps(loaded.model, ids)
        ours = extract_tps(loaded, layers, N_SEQ)
        rows[layers] = {"extract_tokens_per_s": ours, "bare_forward_tokens_per_s": bare, "ratio": ours / bare}
    memory = {}
    for n in (128, 1024, 2048):
        out = subprocess.run([sys.executable, __file__, "--memory", str(n)], capture_output=True, text=True, check=True)
        base, peak = (float(x) for x in out.stdout.split()[-2:])
        memory[n] = {"peak_rss_mib": peak, "after_model_and_corpus_load_mib": base}
    save(
        "extract",
        {
            "model": "smollm2-135m",
            "sequences": N_SEQ,
            "seq_len": SEQ_LEN,
            "batch": BATCH,
            "throughput": rows,
            "peak_memory_by_max_sequences": memory,
        },
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--memory":
        memory_child(int(sys.argv[2]))
    else:
        main()

"""Gen.PPL scoring speed: texts batched (right-padded, EVAL_BATCH per forward) against one forward per
text, for both builtins as evaluators, on held-out-sized pydoc texts (the comparison scores 64
samples of 31 tokens per row, temperature, seed and evaluator). The NLLs of the two ways are
compared too. One run; the ratio is what to quote.

    python benchmarks/bench_evaluate.py      # writes benchmarks/results/evaluate.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, save  # noqa: E402
from dihal.stages.evaluate import EVAL_BATCH, sample_nlls  # noqa: E402
from dihal.stages.lm.models import load_model  # noqa: E402
from dihal.stages.text.data import DataConfig, documents, one_source  # noqa: E402

TEXTS, TOKENS = 64, 31


def texts_of(tokenizer) -> list[str]:
    """TEXTS pieces of pydoc, TOKENS tokens each under this tokenizer."""
    out = []
    for doc in documents(one_source(DataConfig(), "pydoc")):
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - TOKENS, TOKENS * 8):
            out.append(tokenizer.decode(ids[start : start + TOKENS]))
            if len(out) == TEXTS:
                return out
    return out


def main() -> None:
    result = {"texts": TEXTS, "tokens_per_text": TOKENS, "batch": EVAL_BATCH, "evaluators": {}}
    for name in ("smollm2-135m", "gemma3-270m"):
        loaded = load_model(name, "cpu", "float32")
        texts = texts_of(loaded.tokenizer)
        prompts = [""] * len(texts)
        sample_nlls(loaded, prompts[:4], texts[:4])  # warm-up
        with Timer() as one:
            single = sample_nlls(loaded, prompts, texts, batch_size=1)
        with Timer() as many:
            batched = sample_nlls(loaded, prompts, texts)
        a, b = np.array([s for s, _ in single]), np.array([s for s, _ in batched])
        result["evaluators"][name] = {
            "one_text_per_forward_s": one.seconds,
            "batched_s": many.seconds,
            "speedup": one.seconds / many.seconds,
            "max_abs_nll_difference": float(np.abs(a - b).max()),
            "max_rel_nll_difference": float((np.abs(a - b) / np.abs(a)).max()),
        }
    save("evaluate", result)


if __name__ == "__main__":
    main()

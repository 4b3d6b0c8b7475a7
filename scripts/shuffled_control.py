"""Do a prior's samples have order? Their own tokens, shuffled, as the control (issue 52).

The unigram controls of scripts/prior_curve.py draw tokens with the corpus' frequencies; a prior that
concentrates on a few frequent tokens can beat them with no order at all. This control keeps a sample set's
exact token counts and removes only the order: every token of the N rounded samples is permuted across all
positions and samples (seed 0), cut back into sequences of the same lengths, and both sets are scored alike
(decoded to text, Gen.PPL under one model, dihal's evaluate.sample_nlls). A ratio shuffled / as written above
1 is order the samples have; 1 is none.

    python scripts/shuffled_control.py ROOT GENERATE_ID... [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dihal.artifacts.store import ArtifactStore  # noqa: E402
from dihal.stages.lm.models import load_model  # noqa: E402
from scripts.prior_curve import pooled_ppl  # noqa: E402


def gen_ppl(model, rows: list[list[int]]) -> float:
    return pooled_ppl(model, [model.tokenizer.decode(r, skip_special_tokens=True) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("generate", nargs="+")
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args()
    store, model = ArtifactStore(a.root), load_model(a.model, "cpu", "float32")
    print("| samples | prior | as written | shuffled | shuffled / written |\n|---|---|---|---|---|")
    for gid in a.generate:
        art = store.resolve(gid, "generate")
        rows = [
            r for r in (json.loads(x)["token_ids"] for x in art.file("samples.jsonl").read_text().splitlines()) if r
        ]
        flat = np.random.default_rng(0).permutation(np.concatenate([np.asarray(r) for r in rows]))
        cuts = np.cumsum([len(r) for r in rows])[:-1]
        shuffled = [part.tolist() for part in np.split(flat, cuts)]
        written, mixed = gen_ppl(model, rows), gen_ppl(model, shuffled)
        prior = art.manifest["parents"].get("prior", "")
        print(f"| {gid} | {prior} | {written:.0f} | {mixed:.0f} | {mixed / written:.2f} |", flush=True)


if __name__ == "__main__":
    main()

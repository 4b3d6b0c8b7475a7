"""Does a comparison's row write better than order-free frequent tokens? (issue 52)

A prior that collapses onto the corpus' frequent tokens earns a large prior gain without writing
(docs/results/prior.md). This reads one `dihal compare` artifact and scores, at its N and under its two
models, the two frequency controls of scripts/prior_curve.py: tokens drawn i.i.d. from the extract's
train-split unigram distribution, and the same over its 100 most frequent types only (seed 0, 31 tokens,
cut at the first stop token as generation does). Every row's trained-prior text at t = 1 (or its point)
is then read against them: a row whose evaluator Gen.PPL is not below the top-100 control's writes no
better than frequent tokens without order, whatever its prior gain.

    python scripts/frequency_controls.py RUN_ROOT [--compare ID]    # RUN_ROOT/frequency_controls.{csv,md}
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dihal.artifacts import hidden_states as hs  # noqa: E402
from dihal.artifacts.store import ArtifactStore  # noqa: E402
from scripts.prior_curve import markdown, unigram_control  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--compare", default="latest")
    a = ap.parse_args()
    store = ArtifactStore(a.root)
    art = store.resolve(a.compare, "compare")
    extract = store.resolve(art.manifest["parents"]["extract"], "extract")
    evaluator, n = art.config["evaluator"], int(art.config["num_samples"])
    models = SimpleNamespace(model=extract.config["model"], evaluator=evaluator)
    group = hs.open_group(extract)
    ids = np.asarray(group["input_ids"][:])
    train = ids[hs.split_indices(group, "train")][:, 1:].ravel().tolist()
    held = ids[hs.split_indices(group, "validation")][:, 1:].ravel().tolist()
    top100 = {t for t, _ in Counter(train).most_common(100)}
    controls = {
        "unigram control": unigram_control(models, n, train, top100, held),
        "unigram control, top 100 types": unigram_control(models, n, train, top100, held, only=top100),
    }
    soup = controls["unigram control, top 100 types"]["ppl_eval"]
    table = pd.read_csv(art.file("compare.csv"))
    trained = table[(table["source"] == "trained prior") & (table["temperature"].isna() | (table["temperature"] == 1))]
    rows = [
        {
            "row": r.row,
            f"Gen.PPL {evaluator}": r.gen_ppl_token_evaluator,
            f"Gen.PPL {models.model}": r.gen_ppl_token_backbone,
            "entropy": r.token_entropy,
            "vs top-100 control": r.gen_ppl_token_evaluator / soup,
            "writes beyond frequency": bool(r.gen_ppl_token_evaluator < soup),
        }
        for r in trained.itertuples()
    ]
    for name, got in controls.items():
        rows.append(
            {
                "row": f"({name})",
                f"Gen.PPL {evaluator}": got["ppl_eval"],
                f"Gen.PPL {models.model}": got["ppl_backbone"],
                "vs top-100 control": got["ppl_eval"] / soup,
            }
        )
    frame = pd.DataFrame(rows).astype(object).fillna("")
    out = Path(a.root) / "frequency_controls.md"
    frame.to_csv(out.with_suffix(".csv"), index=False)
    head = f"# frequency controls of compare {art.id} ({models.model}, evaluator {evaluator}, N = {n}, t = 1)\n\n"
    out.write_text(head + markdown(frame))
    print(head + markdown(frame))


if __name__ == "__main__":
    main()

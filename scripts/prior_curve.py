"""Does the comparison's prior write? (issue 52) Train priors over h_0 at several budgets and recipes, then
measure what the rounding recovery (nearest token embedding, Diffusion-LM / SED) makes of their samples.

    python scripts/prior_curve.py --root runs/prior-curve --budgets 1,5,25 --variants plain,sc \
        [--model smollm2-135m --evaluator gemma3-270m --dataset pydoc] [--out docs/results/prior_curve.md]

Every step is a `dihal` command (so every artifact is cached, verified and resumable; a rerun only adds what is
missing), on one extract of the compare's shape (--seq-len 32, --val-fraction 0.1, seed 0). A budget k is k
times the compare-cpu protocol's 200 steps at batch 16, the batch of scripts/reproduce_compare.sh.

Per prior, from N samples (--num-samples, seed 0, --prior-steps Euler steps, rounded):
    val_mse      the validation x0 MSE of the prior (normalized units; flow.validation_loss)
    ppl_backbone Gen.PPL of the rounded text under the backbone, ppl_eval under the primary evaluator
    gain         prior gain as `dihal compare` defines it (compare_stats.whose_text): the null prior's
                 Gen.PPL under the evaluator over this prior's. The null prior (zero Euler steps: its noise,
                 rounded) depends only on the extract's statistics and the seed, so it is generated once.
    top100       share of the rounded tokens that are among the 100 most frequent tokens of the train split
    kl           unigram KL(held-out || samples), nats, add-0.5 smoothing over the token types seen in either
                 (held-out: the extract's validation sequences, positions 1..T-1): mass the samples miss
    epochs       epochs of the train split the prior saw; s_per_step its measured seconds per step
Written as CSV and a markdown table (--out), with four reference rows: (null), the null prior; (oracle), the
held-out states rounded (the held-out text itself); (unigram), tokens drawn i.i.d. from the train split's
unigram distribution: the corpus' frequencies without order, which a prior that writes must beat; (unigram,
top 100), the same over the 100 most frequent types only: what collapsing onto them scores without order.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore

BASE_STEPS, BATCH = 200, 16  # compare-cpu's steps; scripts/reproduce_compare.sh's --train-batch
# variant -> train-prior flags. A remedy is one flag (docs/method.md §5); "sc" is SED's self-conditioning.
VARIANTS = {
    "plain": [],
    "sc": ["--self-condition"],
    "shift": ["--time-shift", "3"],
    "ce": ["--token-ce", "0.1"],
    "sc+shift": ["--self-condition", "--time-shift", "3"],
    "sc+ce": ["--self-condition", "--token-ce", "0.1"],
    "shift+ce": ["--time-shift", "3", "--token-ce", "0.1"],
    "sc+shift+ce": ["--self-condition", "--time-shift", "3", "--token-ce", "0.1"],
    # the second round (docs/results/prior.md states its rule): the cross-entropy only where signal and noise
    # weigh at least alike (t <= 0.5), and a prior twice as wide (width 512, the protocol's depth and heads)
    "ce-low": ["--token-ce", "0.1", "--token-ce-max-t", "0.5"],
    "wide": ["--width", "512"],
    "wide+ce": ["--width", "512", "--token-ce", "0.1"],
    "wide+ce-low": ["--width", "512", "--token-ce", "0.1", "--token-ce-max-t", "0.5"],
}


def dihal(root: str, *args: str) -> dict:
    """Run `dihal ARGS --root ROOT` and return the artifact it names on its last `done:` line (id and path)."""
    cmd = [sys.executable, "-m", "dihal.cli", *args, "--root", root]
    print("$ dihal " + shlex.join(args), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: dihal {shlex.join(args)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr}")
    named = re.findall(r"^(?:done|cache hit): \w+ ([0-9a-f]{12}) ->", proc.stdout, re.M)
    if not named:
        sys.exit(f"error: no artifact named by dihal {shlex.join(args)}:\n{proc.stdout[-2000:]}")
    return {"id": named[-1]}


def tokens_of(path: Path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in path.read_text().splitlines()]


def unigram_kl(ref: list[int], got: list[int], alpha: float = 0.5) -> float:
    """KL(ref || got) of unigram distributions, add-alpha over the types seen in either."""
    a, b = Counter(ref), Counter(got)
    types = sorted(set(a) | set(b))
    p = np.array([a[t] for t in types], float) + alpha
    q = np.array([b[t] for t in types], float) + alpha
    p, q = p / p.sum(), q / q.sum()
    return float((p * np.log(p / q)).sum())


def gen_ppl(store: ArtifactStore, root: str, generate: str, evaluator: str, n: int) -> float:
    ev = dihal(root, "evaluate", "--samples", generate, "--evaluator", evaluator, "--limit", str(n), "--device", "cpu")
    per = pd.read_csv(store.resolve(ev["id"], "evaluate").file("per_sample.csv"))
    per = per[per["n_scored"] > 0]
    return float(np.exp(per["nll"].sum() / per["n_scored"].sum()))


def pooled_ppl(model, texts: list[str]) -> float:
    """Gen.PPL of texts under a loaded model, as `dihal evaluate` pools it: exp(summed NLL / scored tokens)."""
    from dihal.stages.evaluate import sample_nlls

    nlls = sample_nlls(model, [""] * len(texts), texts)
    return float(np.exp(sum(x for x, _ in nlls) / sum(c for _, c in nlls)))


def measure(store: ArtifactStore, root: str, generate: str, a, n: int, top100: set, held: list) -> dict:
    """The rounded text's Gen.PPL under the backbone and the evaluator, top-100 share and unigram KL."""
    toks = [t for row in tokens_of(store.resolve(generate, "generate").file("samples.jsonl")) for t in row]
    return {
        "ppl_backbone": gen_ppl(store, root, generate, a.model, n),
        "ppl_eval": gen_ppl(store, root, generate, a.evaluator, n),
        "top100": sum(t in top100 for t in toks) / max(len(toks), 1),
        "kl": unigram_kl(held, toks),
    }


def unigram_control(a, n: int, train: list[int], top100: set, held: list, only: set | None = None) -> dict:
    """The unigram control: n sequences of 31 tokens drawn i.i.d. from the train split's unigram
    distribution (seed 0; `only`: restricted to those types), cut at the first stop token and decoded as
    generation does, scored alike. Text with the corpus' token frequencies and no order: a prior that writes
    must score better than this; restricted to the 100 most frequent types, the control of a prior that
    collapses onto them."""
    from dihal.stages.lm.models import load_model
    from dihal.stages.lm.tokens import truncate

    types, counts = np.unique(np.asarray(train), return_counts=True)
    if only is not None:
        keep = np.isin(types, sorted(only))
        types, counts = types[keep], counts[keep]
    draws = np.random.default_rng(0).choice(types, size=(n, 31), p=counts / counts.sum())
    backbone = load_model(a.model, "cpu", "float32")
    rows = [truncate(r, backbone.stop_ids) for r in draws.tolist()]
    texts = [backbone.tokenizer.decode(r, skip_special_tokens=True) for r in rows]
    out = {
        key: pooled_ppl(load_model(name, "cpu", "float32"), texts)
        for name, key in ((a.model, "ppl_backbone"), (a.evaluator, "ppl_eval"))
    }
    toks = [t for r in rows for t in r]
    return {**out, "top100": sum(t in top100 for t in toks) / len(toks), "kl": unigram_kl(held, toks)}


def markdown(frame: pd.DataFrame) -> str:
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--evaluator", default="gemma3-270m")
    ap.add_argument("--dataset", default="pydoc")
    ap.add_argument("--budgets", default="1,5,25")
    ap.add_argument("--variants", default="plain,sc")
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--prior-steps", type=int, default=50)  # scripts/reproduce_compare.sh's
    ap.add_argument("--prior-args", default="", help="more train-prior flags for every prior (e.g. --data corpus)")
    ap.add_argument("--generate-args", default="", help="more generate flags for every trained prior (e.g. --clamp)")
    ap.add_argument("--out", default=None, help="markdown table (default: <root>/prior_curve.md)")
    a = ap.parse_args()
    root, n = a.root, a.num_samples
    Path(root).mkdir(parents=True, exist_ok=True)
    store = ArtifactStore(root)
    ex = dihal(root, "extract", "--model", a.model, "--dataset", a.dataset, "--seq-len", "32", "--layers", "0")
    group = hs.open_group(store.resolve(ex["id"], "extract"))
    ids = np.asarray(group["input_ids"][:])
    train = ids[hs.split_indices(group, "train")][:, 1:].ravel().tolist()
    held = ids[hs.split_indices(group, "validation")][:, 1:].ravel().tolist()
    top100 = {t for t, _ in Counter(train).most_common(100)}
    steps = ["--recovery", "rounding", "--prior-steps", str(a.prior_steps), "--batch-size", "64", "--seed", "0"]
    sample = lambda count: [*steps, "--num-samples", str(count), "--device", "cpu"]
    rows, null = [], None
    for variant in a.variants.split(","):
        for k in [int(b) for b in a.budgets.split(",")]:
            flags = [*VARIANTS[variant], *shlex.split(a.prior_args)]
            args = ["--extract", ex["id"], "--batch-size", str(BATCH), "--train-steps", str(BASE_STEPS * k)]
            prior = dihal(root, "train-prior", *args, *flags, "--device", "cpu")
            art = store.resolve(prior["id"], "prior")
            m = art.manifest["metrics"]
            if null is None:  # the references, the same for every prior of this extract and seed: the null
                # prior (noise rounded) and the oracle (held-out states rounded: the held-out text itself)
                refs = {}
                for source in ("null", "oracle"):  # the oracle reads held-out sequences: as many as there are
                    count = n if source == "null" else min(n, len(hs.split_indices(group, "validation")))
                    made = ["generate", "--mode", "parallel", "--prior", prior["id"], f"--source={source}"]
                    ref = dihal(root, *made, *sample(count))
                    refs[source] = measure(store, root, ref["id"], a, count, top100, held)
                null_ppl = refs["null"]["ppl_eval"]
                null = refs
            more = shlex.split(a.generate_args)
            gen = dihal(root, "generate", "--mode", "parallel", "--prior", prior["id"], *sample(n), *more)
            got = measure(store, root, gen["id"], a, n, top100, held)
            rows.append(
                {
                    "variant": variant,
                    "budget": k,
                    "steps": m["steps"],
                    "epochs": round(m["epochs_seen"], 2),
                    "val_mse": m["val_loss"],
                    **got,
                    "gain": null_ppl / got["ppl_eval"],
                    "s_per_step": m["tokens_seen"] / m["train_tokens_per_s"] / m["steps"],
                    "prior": prior["id"],
                    "flags": " ".join(flags + more),
                }
            )
            print(pd.DataFrame(rows[-1:]).to_string(index=False), flush=True)
    null["unigram"] = unigram_control(a, n, train, top100, held)
    null["unigram, top 100"] = unigram_control(a, n, train, top100, held, only=top100)
    for source, got in null.items():
        rows.append({"variant": f"({source})", **got, "gain": null_ppl / got["ppl_eval"]})
    frame = pd.DataFrame(rows).astype(object).fillna("")
    out = Path(a.out or Path(root) / "prior_curve.md")
    frame.to_csv(out.with_suffix(".csv"), index=False)
    ref = f"held-out text's own top100 share: {sum(t in top100 for t in held) / len(held):.3f}"
    out.write_text(
        f"# prior budget curve: {a.model} on {a.dataset}, evaluator {a.evaluator}, N = {n}\n\n{ref}\n\n"
        + markdown(frame)
    )
    print(f"wrote {out} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()

"""Issue 19's table from a `scripts/own_text.sh` run: per training data (pydoc, own, mix), mean +- std
over seeds of the bridge's perplexity ratio and KL on held-out pydoc, this repository's prose and
the backbone's own held-out samples, and the AR hybrid's and the original's Gen.PPL under both
evaluators, with diversity and token entropy. Written as own_text.csv and own_text.md in the root;
the KL on the held-out own samples by position (does it fall with context?) as
own_text_kl_by_position.csv and .png.

    python3 scripts/own_text.py runs/own-text-smollm2-135m [--earlier benchmarks/own_text/smollm2-135m]

A store lives on one machine, and one session's 2 cores do not hold every seed of a backbone, so the
per-bridge rows (own_text.csv, own_text_kl_by_position.csv) are kept in the repository under
benchmarks/own_text/MODEL/ and pooled in with --earlier: the earlier rows of bridges that this store
does not hold join the table (the store's own rows win), and the table says how many came from where.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from dihal.artifacts.store import ArtifactStore
from dihal.stages.configs import PROTOCOLS


def data_kind(extract) -> str:
    specs = [extract.config["data"]["dataset"], *extract.config["data"].get("also", [])]
    own = [s.startswith("generate:") for s in specs]
    return "own" if all(own) else "mix" if any(own) else "pydoc"


RECIPE_FIELDS = ("steps", "width", "depth", "lr")  # a bridge that changes one of its protocol's is a row of its own
BASE_SEQUENCES = 896  # scripts/own_text.sh's extracts (its MAX_SEQUENCES default)


def label(bridge, extract) -> str:
    """The training text, plus what else differs from the measured recipe (a longer budget, a larger bridge,
    a larger extract), so that variants are their own rows and never pooled into the recipe's seeds."""
    protocol = PROTOCOLS[bridge.config["protocol"]]
    extras = [f"{bridge.config[k]} {k}" for k in RECIPE_FIELDS if bridge.config[k] != protocol[k]]
    if extract.manifest["metrics"]["n_sequences"] != BASE_SEQUENCES:
        extras.append(f"{extract.manifest['metrics']['n_sequences']} seqs")
    return ", ".join([data_kind(extract), *extras])


def minutes(art) -> float:
    """Wall minutes from the artifact's start to its completion (a resumed run counts from its last start)."""
    return (pd.Timestamp(art.manifest["finished"]) - pd.Timestamp(art.manifest["started"])).total_seconds() / 60


def text_of(source: str) -> str:
    if source.startswith("extract "):  # scripts/own_text.sh: the pydoc extract's validation split, for all
        return "pydoc"
    return "prose" if source.startswith("dataset ") else "own"


POSITION_BINS = [(1, 4), (5, 8), (9, 16), (17, 32), (33, 63)]


def rows(store: ArtifactStore, by_position: list[dict]) -> list[dict]:
    evaluations = [a for a in store.all("evaluate") if a.complete]
    generations = [a for a in store.all("generate") if a.complete and "bridge" in a.manifest["parents"]]
    out = []
    for bridge in (b for b in store.all("bridge") if b.complete):
        extract = store.load("extract", bridge.manifest["parents"]["extract"])
        row = {
            "data": label(bridge, extract),
            "seed": bridge.config["seed"],
            "model": extract.config["model"],
            "bridge": bridge.id,
            "bridge val_loss": bridge.manifest["metrics"]["val_loss"],
            "bridge train_loss": bridge.manifest["metrics"]["final_train_loss"],
            "bridge minutes": minutes(bridge),
        }
        for ev in (e for e in evaluations if e.manifest["parents"].get("bridge") == bridge.id):
            m = ev.manifest["metrics"]
            fid = m["fidelity"][-1]  # the most sampler steps
            text = text_of(m["source"])
            if text == "own" and m.get("held_out") is False:
                text = "own (trained on)"
            row |= {f"ppl_ratio {text}": fid["ppl_ratio"], f"kl {text}": fid["kl"]}
            if text == "own":
                kl = pd.read_csv(ev.file("fidelity_by_position.csv"))
                kl = kl[kl["steps"] == kl["steps"].max()]
                for lo, hi in POSITION_BINS:
                    part = kl[(kl["position"] >= lo) & (kl["position"] <= hi)]
                    if len(part):
                        weights = part["n"] / part["n"].sum()
                        by_position.append(
                            {**row, "positions": f"{lo}-{hi}", "kl": float((part["kl"] * weights).sum())}
                        )
        for gen in (g for g in generations if g.manifest["parents"]["bridge"] == bridge.id):
            for ev in (
                e
                for e in evaluations
                if e.manifest["parents"].get("generate") == gen.id and "bridge" not in e.manifest["parents"]
            ):
                m = ev.manifest["metrics"]
                judge = "backbone" if not ev.config.get("evaluator") else "other"
                for r in m["rows"]:
                    row[f"gen_ppl {r['model']} ({judge})"] = r["gen_ppl_token"]
                    if judge == "backbone":
                        row[f"diversity {r['model']}"], row[f"entropy {r['model']}"] = (
                            r["diversity"],
                            r["token_entropy"],
                        )
        out.append(row)
    return out


GOALS = """issue 19's goals, on the means over seeds (pydoc: the bridge trained on pydoc alone):
  own-sample PPL ratio <= 1.15; held-out pydoc PPL ratio <= 1.05 x pydoc's;
  hybrid Gen.PPL under the other evaluator <= 1.3 x the original's; diversity within 0.02 of the original's"""


def goals(mean: pd.DataFrame) -> list[str]:
    """One line per training text: each goal met or not, with its number."""
    nan = float("nan")
    base = mean["ppl_ratio pydoc"].get("pydoc", nan) if "ppl_ratio pydoc" in mean else nan
    lines = [GOALS]
    for data, m in mean.iterrows():
        checks = [
            ("own <= 1.15", m.get("ppl_ratio own", nan), lambda v: v <= 1.15),
            ("pydoc <= 1.05x", m.get("ppl_ratio pydoc", nan) / base, lambda v: v <= 1.05),
            ("Gen.PPL other <= 1.3x", m.get("gen_ppl ratio (other)", nan), lambda v: v <= 1.3),
            ("diversity", m.get("diversity hybrid", nan) - m.get("diversity original", nan), lambda v: abs(v) <= 0.02),
        ]
        cells = [f"{name}: {v:.3g} {'met' if ok(v) else 'missed'}" for name, v, ok in checks if pd.notna(v)]
        lines.append(f"  {data}: " + "; ".join(cells))
    return lines


def pool(here: pd.DataFrame, earlier: Path | None, name: str) -> pd.DataFrame:
    """This store's rows plus the earlier ones (earlier/name) of bridges it does not hold; one backbone."""
    if earlier is None:
        return here
    if not (earlier / name).is_file():
        sys.exit(f"error: --earlier {earlier} holds no {name}; give the folder own_text.py's outputs were copied to")
    kept = pd.read_csv(earlier / name)
    missing = [c for c in ("model", "bridge") if c not in kept]
    if missing:
        sys.exit(f"error: {earlier / name} has no {' or '.join(missing)} column; rerun own_text.py on its store")
    models = sorted(set(here["model"]) | set(kept["model"]))
    if len(models) > 1:
        sys.exit(f"error: --earlier {earlier} is of {', '.join(models)}; pool rows of one backbone only")
    return pd.concat([here, kept[~kept["bridge"].isin(set(here["bridge"]))]], ignore_index=True)


def plot_positions(frame: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    order = [f"{lo}-{hi}" for lo, hi in POSITION_BINS]
    for data, part in frame.groupby("data"):
        stats = part.groupby("positions")["kl"].agg(["mean", "std"]).reindex(order)
        seeds = part["seed"].nunique()
        name = f"{data} ({seeds} seed{'s' if seeds > 1 else ''})"
        ax.errorbar(range(len(order)), stats["mean"], yerr=stats["std"].fillna(0), label=name, capsize=3, marker="o")
    ax.set_xticks(range(len(order)), order)
    ax.set(xlabel="position (tokens after the start token)", ylabel="KL(original || hybrid)")
    ax.set_title("held-out own samples", fontsize=10)
    ax.legend(title="trained on", fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(root: str, earlier: Path | None = None) -> None:
    by_position: list[dict] = []
    store = ArtifactStore(root)
    table = pd.DataFrame(rows(store, by_position))
    if table.empty:
        sys.exit(f"error: no bridges under {root}; run scripts/own_text.sh first")
    here = len(table)
    table = pool(table, earlier, "own_text.csv")
    for model in ("hybrid", "original"):
        for judge in ("backbone", "other"):
            col = f"gen_ppl {model} ({judge})"
            if col not in table:
                table[col] = float("nan")
    for judge in ("backbone", "other"):
        table[f"gen_ppl ratio ({judge})"] = table[f"gen_ppl hybrid ({judge})"] / table[f"gen_ppl original ({judge})"]
    table.to_csv(Path(root) / "own_text.csv", index=False)
    numbers = table.drop(columns=["seed", "model", "bridge"]).groupby("data")
    order = [d for d in ("pydoc", "own", "mix") if d in numbers.groups]
    order += sorted(set(numbers.groups) - set(order))  # the variants after the recipe's three rows
    mean, std, n = numbers.mean().loc[order], numbers.std(ddof=1).loc[order], numbers.size().loc[order]
    cells = mean.map(lambda v: f"{v:.3g}").astype(str) + std.map(lambda v: "" if pd.isna(v) else f" ± {v:.2g}")
    cells.insert(0, "seeds", n.astype(str))
    cells = cells.T
    lines = ["| measure | " + " | ".join(cells.columns) + " |", "|---" * (len(cells.columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(map(str, r)) + " |" for name, r in cells.iterrows()]
    origin = f"{here} bridges from {root}" + (f", {len(table) - here} from {earlier}" if earlier else "")
    lines += ["", f"rows: {origin}", "", *goals(mean)]
    samples = {  # the own samples each extract drew on, and what they cost
        spec: store.load("generate", spec.removeprefix("generate:"))
        for e in store.all("extract")
        if e.complete
        for spec in [e.config["data"]["dataset"], *e.config["data"].get("also", [])]
        if spec.startswith("generate:")
    }
    lines += [
        f"own samples {a.id}: {a.config['num_samples']} at seed {a.config['seed']}, {minutes(a):.1f} min"
        for a in samples.values()
    ]
    text = "\n".join(lines)
    (Path(root) / "own_text.md").write_text(text + "\n")
    print(text)
    if by_position:
        frame = pd.DataFrame(by_position)[["data", "seed", "model", "bridge", "positions", "kl"]]
        frame = pool(frame, earlier, "own_text_kl_by_position.csv")
        frame.to_csv(Path(root) / "own_text_kl_by_position.csv", index=False)
        plot_positions(frame, Path(root) / "own_text_kl_by_position.png")
        wide = frame.groupby(["data", "positions"])["kl"].mean().unstack()
        print("\nKL on held-out own samples by position (mean over seeds)")
        print(wide[[f"{lo}-{hi}" for lo, hi in POSITION_BINS if f"{lo}-{hi}" in wide]].round(3).to_string())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the DIHAL_ROOT of a scripts/own_text.sh run")
    parser.add_argument("--earlier", type=Path, help="a folder with an earlier run's own_text.csv and KL csv")
    args = parser.parse_args()
    main(args.root, args.earlier)

"""A corpus several times the builtin pydoc's size and of its kind, for `train-prior --data corpus:FILE`
(issue 52): the docstrings that installed packages ship (read with `ast`, nothing imported), one JSON line
per docstring of at least --min-chars characters, in a fixed order (package, then path, then position).

    python scripts/docstrings_corpus.py runs/corpora/docstrings.jsonl [--packages numpy,scipy,...]

pydoc is the standard library's documentation; these are the scientific stack's, which a researcher's
machine has (the versions are written beside the file, in <out>.versions.json). The file's content, not its
path, names every prior trained on it (stages/train_prior.py hashes it into the id).
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
from pathlib import Path

PACKAGES = "numpy,scipy,pandas,torch,transformers,sklearn,matplotlib,datasets"


def docstrings(path: Path, min_chars: int):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars:
                yield doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--packages", default=PACKAGES)
    ap.add_argument("--min-chars", type=int, default=200)
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    versions, count, chars = {}, 0, 0
    with out.open("w") as f:
        for name in a.packages.split(","):
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                print(f"skipped {name}: not installed")
                continue
            dist = {"sklearn": "scikit-learn"}.get(name, name)
            versions[name] = importlib.metadata.version(dist)
            for root in spec.submodule_search_locations:
                for path in sorted(Path(root).rglob("*.py")):
                    if "tests" in path.parts:
                        continue
                    for doc in docstrings(path, a.min_chars):
                        f.write(json.dumps({"text": doc}) + "\n")
                        count, chars = count + 1, chars + len(doc)
    Path(f"{out}.versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    print(f"wrote {count} docstrings, {chars / 1e6:.1f}M characters, to {out} ({versions})")


if __name__ == "__main__":
    main()

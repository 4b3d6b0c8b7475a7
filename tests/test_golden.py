"""A golden test per computing stage (issue 45): one fixed tiny input through every stage, each stage's
output compared with the one recorded under its CACHE_VERSION (tests/golden.py). When a stage computes
other bytes and its CACHE_VERSION did not move, its old artifacts would keep serving under the same id:
the test fails and names the version to bump."""

from __future__ import annotations

import importlib
import os
import shutil

import pytest

from dihal.artifacts.store import ArtifactStore
from tests import golden
from tests.conftest import ROOT, invoke

pytestmark = pytest.mark.slow
TINY = ["--width", "16", "--depth", "1", "--heads", "2", "--batch-size", "4", "--device", "cpu"]
TASKS = ROOT / "tests" / "data" / "lm_eval"

# golden name -> (the module whose CACHE_VERSION keys it, how to find its artifact in the chain's store)
STAGES = {
    "extract": ("extract", lambda s: _chain_extract(s)),
    "score": ("score", lambda s: _one(s, "score", lambda a: a.config["pairs"] == 50)),
    "bridge": ("train_bridge", lambda s: _one(s, "bridge", lambda a: a.config["steps"] == 6)),
    "evaluate-fidelity": ("evaluate", lambda s: _one(s, "evaluate", lambda a: _fidelity_of_chain_bridge(s, a))),
    "generate-ar": ("generate", lambda s: _ar_generation(s)),
    "evaluate-samples": (
        "evaluate",
        lambda s: _one(s, "evaluate", lambda a: a.manifest["parents"] == {"generate": _ar_generation(s).id}),
    ),
    "generate-original": ("generate", lambda s: _one(s, "generate", lambda a: a.config["baseline"] == "original-only")),
    "prior": ("train_prior", lambda s: _on_chain_extract(s, "prior")),
    "decoder": ("train_decoder", lambda s: _on_chain_extract(s, "decoder")),
    "autoencoder": ("train_autoencoder", lambda s: _on_chain_extract(s, "autoencoder")),
    "generate-parallel": (
        "generate",
        lambda s: _one(s, "generate", lambda a: a.manifest["parents"] == {"prior": _on_chain_extract(s, "prior").id}),
    ),
    "sweep": ("sweep", lambda s: s.resolve("latest", "sweep")),
    "confirm": ("confirm", lambda s: s.resolve("latest", "confirm")),
    "evaluate-lm-eval": ("evaluate_harness", lambda s: _one(s, "evaluate", lambda a: a.config["kind"] == "lm_eval")),
    "compare": ("compare", lambda s: s.resolve("latest", "compare")),
}


def _one(store, stage, keep):
    (art,) = [a for a in store.all(stage) if a.complete and keep(a)]
    return art


def _chain_extract(store):
    data = lambda a: (a.config["data"]["seq_len"], a.config["data"]["max_sequences"])
    return _one(store, "extract", lambda a: data(a) == (12, 24))


def _on_chain_extract(store, stage):
    return _one(store, stage, lambda a: a.manifest["parents"] == {"extract": _chain_extract(store).id})


def _ar_generation(store):
    bridge = _one(store, "bridge", lambda a: a.config["steps"] == 6)
    return _one(store, "generate", lambda a: a.manifest["parents"] == {"bridge": bridge.id})


def _fidelity_of_chain_bridge(store, art) -> bool:
    bridge = _one(store, "bridge", lambda a: a.config["steps"] == 6)
    return art.config["kind"] == "fidelity" and art.manifest["parents"] == {"bridge": bridge.id}


def ok(*args: str) -> None:
    res = invoke(*args)
    assert res.exit_code == 0, (args, res.output)


def make_chain(tiny_dirs) -> None:
    """Every stage once on the tiny llama (greedy decoding, so token ids do not hang on a draw)."""
    llama, qwen = str(tiny_dirs["llama"]), str(tiny_dirs["qwen3"])
    ok("extract", "--model", llama, "--max-sequences", "24", "--seq-len", "12", "--layers", "0-3")
    ok("score", "--extract", "latest", "--tokens", "100", "--k", "4", "--candidates", "1,2,3", "--pairs", "50")
    ok("train-bridge", "--layer", "2", "--extract", "latest", "--protocol", "sweep-tiny", "--train-steps", "6", *TINY)
    bridge = ArtifactStore(os.environ["DIHAL_ROOT"]).resolve("latest", "bridge").id
    ok("evaluate", "--bridge", bridge, "--sample-steps", "2", "--limit", "3", "--device", "cpu")
    gen = ["--num-samples", "2", "--max-new-tokens", "5", "--temperature", "0", "--device", "cpu"]
    ok("generate", "--bridge", bridge, *gen)
    ok("evaluate", "--samples", "latest", "--device", "cpu")
    ok("generate", "--baseline", "original-only", "--model", llama, *gen)
    ok("train-prior", "--extract", "latest", "--train-steps", "6", *TINY)
    ok("train-decoder", "--extract", "latest", "--train-steps", "3", *[a for a in TINY if a not in ("--depth", "1")])
    ok("train-autoencoder", "--extract", "latest", "--train-steps", "3", "--width", "16", "--batch-size", "4")
    ok("generate", "--mode", "parallel", "--prior", "latest", "--num-samples", "3", "--device", "cpu")
    ok(
        "sweep",
        "--extract",
        "latest",
        "--layers",
        "1,2",
        "--tokens",
        "100",
        "--train-steps",
        "3",
        "--eval-limit",
        "2",
        *TINY,
    )
    confirm = ["--protocol", "sweep-tiny", "--train-steps", "3", "--train-batch", "4", "--seeds", "0"]
    confirm += ["--num-samples", "2", "--eval-limit", "2", "--sample-steps", "2", "--evaluator", qwen]
    ok("confirm", *confirm, "--width", "16", "--depth", "1", "--device", "cpu")
    compare = ["--max-sequences", "48", "--seq-len", "12", "--seeds", "0", "--num-samples", "4", "--prior-steps", "3"]
    compare += ["--sample-steps", "2", "--train-steps", "3", "--width", "16", "--depth", "1", "--tokens", "150"]
    compare += ["--temperatures", "0,1", "--budgets", "1", "--rows", "sed,dihal", "--controls", "dihal"]
    ok("compare", "--model", llama, "--evaluator", qwen, *compare, "--device", "cpu")
    # the local tasks' contexts need 64 positions: a bridge of its own (the hybrid stops at its length)
    ok("extract", "--model", llama, "--max-sequences", "12", "--seq-len", "64", "--layers", "0,2")
    ok("train-bridge", "--layer", "2", "--extract", "latest", "--protocol", "sweep-tiny", "--train-steps", "2", *TINY)
    lm_eval = ["--lm-eval", "dihal_pydoc_mc,dihal_pydoc_ppl", "--lm-eval-include", str(TASKS), "--lm-eval-limit", "4"]
    ok("evaluate", "--bridge", "latest", *lm_eval, "--device", "cpu")


@pytest.fixture(scope="session")
def chain_root(tiny_dirs, tmp_path_factory):
    """The chain's store, made once for the whole session (every xdist worker shares it)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's, never an older one's
    path = shared / "golden-chain" / "runs"
    with FileLock(str(shared / "golden-chain.lock")):
        if not (path.parent / "done").exists():
            shutil.rmtree(path.parent, ignore_errors=True)
            import torch

            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # one thread: sums in one order, on any machine's core count
            try:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setenv("DIHAL_ROOT", str(path))
                    make_chain(tiny_dirs)
            finally:
                torch.set_num_threads(threads)
            (path.parent / "done").write_text("")
    return path


@pytest.mark.parametrize("name", list(STAGES))
def test_stage_output_matches_its_golden_record_or_its_cache_version_moved(name, chain_root):
    module, find = STAGES[name]
    version = importlib.import_module(f"dihal.stages.{module}").CACHE_VERSION
    store = ArtifactStore(chain_root)
    art = find(store)
    got, computed_from = golden.view(art), golden.lineage(art, store)
    if golden.updating():  # written, and said so: a record compared with itself would prove nothing
        golden.write(name, version, computed_from, got)
        pytest.skip(f"DIHAL_GOLDEN=update: recorded {name} anew under CACHE_VERSION {version}, not compared")
    recorded, recorded_from, want = golden.read(name)
    assert recorded is not None, f"no golden record for {name}: DIHAL_GOLDEN=update pytest -m slow tests/test_golden.py"
    problems = golden.differences(got, want, name)
    if recorded_from is not None and recorded_from != computed_from and recorded == version:
        pytest.fail(
            f"the chain's {name} is another computation now (a config of it or of a parent moved, so its id "
            "moved too and no artifact is served stale): record it anew (DIHAL_GOLDEN=update pytest -m slow "
            "tests/test_golden.py)"
        )
    if recorded != version:
        pytest.fail(
            f"stages/{module}.py's CACHE_VERSION is {version}, the golden record of {name} was made under "
            f"{recorded}: record it anew (DIHAL_GOLDEN=update pytest -m slow tests/test_golden.py)"
        )
    assert not problems, (
        f"{name} computes other bytes under the same CACHE_VERSION {version} (its old artifacts would be served "
        f"under their ids): bump CACHE_VERSION in stages/{module}.py and record the golden outputs anew. "
        + "; ".join(problems[:6])
    )

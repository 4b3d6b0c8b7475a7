"""scripts/reproduce_paper.sh, run for real (issue 46): the script itself, its own commands and flags, on
random models of Llama-3.1-8B's and Qwen3-8B's shapes (3 blocks, shrunk widths, the project's small
tokenizers with each model's special tokens) over local Dolma-format shards, at sizes set from the
environment; then every command of it under torchrun on two gloo ranks for the Qwen3 shape, which must make
the same artifacts with the same content. And the score's host memory against estimate.py's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dihal.artifacts.store import ArtifactStore
from tests import golden
from tests.conftest import ROOT, load_script, tiny_tokenizer
from tests.test_dolma import write_shards

pytestmark = pytest.mark.slow
SHAPES = {"llama-3.1-8b": True, "qwen3-8b": False}  # shape -> its tokenizer has a BOS
SIZES = {
    "SEQUENCES": "64",
    "SCORE_SEQUENCES": "32",  # STATES=model (the default): every layer of these for the score, layer 0 of all
    "SEQ_LEN": "16",
    "BATCH": "8",
    "TOKENS": "200",
    "EVAL_LIMIT": "4",
    "LIMIT": "8",
    "EVAL_STEPS": "2,4",
    "SAMPLE_STEPS": "2",
    "NUM_SAMPLES": "4",
    "GEN_BATCH": "4",
    "SEEDS": "0",
    "BUDGETS": "1",
    "COMPARE_SAMPLES": "4",
    "PRIOR_STEPS": "3",
    "COMPARE_BATCH": "4",
    "TEMPERATURES": "0,1",  # two points a curve, and the controls of DiHAL alone: 16 generations, not 28
    "CONTROLS": "dihal",
    "RECIPE": "--train-steps 3 --width 16 --depth 1 --heads 2 --batch-size 4",
    "DEVICE": "cpu",
    "DTYPE": "float32",
}
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=384)


@pytest.fixture(scope="module")
def paper_inputs(tmp_path_factory) -> dict:
    """{shape: model directory} and the shards' glob."""
    base = tmp_path_factory.mktemp("paper")
    make = load_script("make_random_model").make
    models = {}
    for like, bos in SHAPES.items():
        tokenizer = base / f"tokenizer-{like}"
        tiny_tokenizer(bos=bos).save_pretrained(tokenizer)
        models[like] = make(like, 3, base / f"random-{like}", tokenizer, "cpu", 0, **SMALL)
    write_shards(base / "dolma")
    return {"models": models, "dataset": f"dolma:{base}/dolma/dolma-v1_7/*/*.json.gz", "base": base}


def run_script(inputs: dict, root, dihal: str | None = None, only: str = "") -> subprocess.CompletedProcess:
    lines = "\n".join(f"{path} 1-2 {like}" for like, path in inputs["models"].items())
    env = {**os.environ, **SIZES, "MODELS": lines, "DATASET": inputs["dataset"], "ROOT_BASE": str(root), "ONLY": only}
    env.pop("DIHAL_ROOT", None)
    if dihal:
        env |= {"DIHAL": dihal, "OMP_NUM_THREADS": "1"}
    script = ROOT / "scripts" / "reproduce_paper.sh"
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=1500)


def ids(root) -> dict[str, list[str]]:
    store = ArtifactStore(root)
    return {
        stage: sorted(a.id for a in store.all(stage))
        for stage in ("extract", "score", "sweep", "bridge", "generate", "compare")
    }


def test_the_paper_script_runs_end_to_end_and_the_same_under_torchrun(paper_inputs):
    """Before: the script read a `bridge` column sweep.csv has not (KeyError after both sweeps), could not
    read Dolma, and its score, evaluate, generate and compare died under torchrun."""
    plain = run_script(paper_inputs, paper_inputs["base"] / "runs")
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-3000:]
    for like, path in paper_inputs["models"].items():
        root = paper_inputs["base"] / "runs" / path.name
        assert (root / "summary.md").is_file() and "l*" in (root / "summary.md").read_text()
        extract = ArtifactStore(root).resolve("latest", "extract")
        ends = {"llama-3.1-8b": "<|end_of_text|>", "qwen3-8b": "<|endoftext|>"}  # not the chat turn's end
        assert extract.manifest["document_end"]["token"] == ends[like]
        (dolma,) = extract.manifest["dolma"].values()
        assert {s["source"] for s in dolma["shards"]} == {"algebraic-stack", "c4"}
        assert [a.status for a in ArtifactStore(root).all()] == ["complete"] * len(ArtifactStore(root).all())
    # under torchrun, the Qwen3 shape (no BOS, the compare where rank 0 once aborted) with its evaluator the
    # Llama shape, as in the plain run (ONLY=); the Llama shape's every stage runs under torchrun by content in
    # tests/test_paper_scale.py, and each backbone's run costs here about 90 s of a 2-core machine's suite
    qwen = paper_inputs["models"]["qwen3-8b"]
    torchrun = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2 -m dihal.cli"
    ranks = run_script(paper_inputs, paper_inputs["base"] / "ranks", torchrun, only=str(qwen))
    assert ranks.returncode == 0, ranks.stdout[-2000:] + ranks.stderr[-3000:]
    assert not (paper_inputs["base"] / "ranks" / paper_inputs["models"]["llama-3.1-8b"].name).exists()  # ONLY held
    for path in [qwen]:
        one, two = paper_inputs["base"] / "runs" / path.name, paper_inputs["base"] / "ranks" / path.name
        assert ids(two) == ids(one)  # every command under two ranks: the same artifacts, one of each
        for stage in ("extract", "score", "compare"):  # and the same content: the extract's arrays, the tables
            a, b = (ArtifactStore(r).resolve("latest", stage) for r in (two, one))
            moved = golden.differences(golden.view(a), golden.view(b))
            assert not moved, (path.name, stage, moved[:4])
        assert ArtifactStore(two).resolve("latest", "extract").manifest["world_size"] == 2
        assert (two / "summary.md").is_file()


PEAK = """import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, capture_output=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"""


def test_the_estimate_of_the_scores_host_memory_is_within_1_5x_of_its_peak(tmp_path):
    """A width-512 random Llama over 200 sequences of 64 tokens (8,192 ridge rows from 11,520 positions):
    the peak resident memory of `dihal score`, in a process of its own, against estimate.py's."""
    make = load_script("make_random_model").make
    estimate = load_script("estimate")
    tokenizer = tmp_path / "tokenizer"
    tiny_tokenizer().save_pretrained(tokenizer)
    model = make("llama-3.1-8b", 3, tmp_path / "model", tokenizer, "cpu", 0, **{**SMALL, "hidden_size": 512})
    root = str(tmp_path / "runs")
    cli = [sys.executable, "-m", "dihal.cli"]
    extract = [*cli, "extract", "--model", str(model), "--max-sequences", "200", "--seq-len", "64", "--device", "cpu"]
    subprocess.run([*extract, "--root", root], check=True, capture_output=True)
    peak = subprocess.run(
        [sys.executable, "-c", PEAK, *cli, "score", "--extract", "latest", "--root", root],
        check=True,
        capture_output=True,
        text=True,
    )
    measured = int(peak.stdout.strip())
    store = ArtifactStore(root)
    tokens, pool = (
        store.resolve("latest", "score").config["tokens"],
        store.resolve("latest", "extract").config["score_pool"],
    )
    predicted = estimate.score_host_bytes(512, tokens, pool)
    assert 1 / 1.5 < predicted / measured < 1.5, (predicted / 2**20, measured / 2**20)

"""Shared fixtures: tiny random backbones built from configs in-process, saved as local model
directories so the CLI can load them like any user model, plus a tiny trained BPE tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _one_share_of_the_cores_per_worker() -> None:
    """Under xdist, each of N workers (and every process its tests start, which inherit the environment) gets
    cores / N threads for torch's OpenMP and numpy's BLAS, set before torch is imported. Left to their
    defaults, N workers each run N threads on N cores, and the spinning threads oversubscribe the machine:
    six slow tests took 194 s that way and 104 s this way, on 2 cores (2026-12-06). A variable already set
    is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = str(max(1, len(os.sched_getaffinity(0)) // workers))
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, share)


_one_share_of_the_cores_per_worker()

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("COLUMNS", "240")  # rich wraps long lines at the terminal width
# converted builtins and remembered hashes go to the repository's own .cache/ (shared by the workers and by
# later runs), never into the user's ~/.cache/dihal; DIHAL_TEST_CACHE names another folder
os.environ["DIHAL_CACHE"] = os.environ.get("DIHAL_TEST_CACHE") or str(ROOT / ".cache" / "dihal-tests")


def _build_the_cli_once() -> None:
    """typer's CliRunner rebuilds the click command from the app's signatures on every invoke (about 30 ms,
    90% of a `--dry-run` call); the app does not change after import, so the tests build it once per worker.
    `dihal` itself builds it once per process, so this changes nothing a test can observe."""
    import functools

    import typer.testing

    typer.testing._get_command = functools.cache(typer.testing._get_command)


_build_the_cli_once()


# The few tests of over ~40 s on 2 cores, longest first. They run first (pytest_collection_modifyitems) and
# xdist's worksteal scheduler (pyproject's addopts) lets the other worker take tests from the queue of the
# one busy with them, so no long test starts last and leaves one core idle at the end. A renamed test only
# loses its place here.
LONGEST_FIRST = (
    "tests/test_paper_script.py::test_the_paper_script_runs_end_to_end_and_the_same_under_torchrun",
    "tests/test_compare.py::test_compare_on_two_ranks_writes_one_process_table_bit_for_bit_and_resumes_under_either",
    "tests/test_paper_script.py::test_the_estimate_of_the_scores_host_memory_is_within_1_5x_of_its_peak",
    "tests/test_storage.py::test_the_main_job_runs_the_chain_and_ends_with_one_summary",
    "tests/test_store_faults.py::test_kills_during_training_leave_each_step_once_and_the_last_kill_redoes_nothing",
    "tests/test_paper_scale.py::test_a_killed_data_parallel_run_resumes_to_the_uninterrupted_weights",
    "tests/test_compare.py::test_compare_end_to_end_writes_curves_controls_budgets_and_the_verdict",
    "tests/test_paper_scale.py::test_every_stage_under_torchrun_writes_one_artifact_with_one_id",
)


def pytest_collection_modifyitems(items) -> None:
    rank = lambda item: next((i for i, n in enumerate(LONGEST_FIRST) if item.nodeid.startswith(n)), len(LONGEST_FIRST))
    items.sort(key=rank)  # stable: every other test keeps its place


@pytest.fixture
def no_model_loads(monkeypatch):
    forbid_model_loads(monkeypatch)


def forbid_model_loads(monkeypatch) -> None:
    """From here on, any model load fails the test. The stage modules that bind load_model by name are
    imported first and patched too: patching only the defining module would both miss them and, where one
    is first imported under the patch, leave it holding the stub for every later test of the worker."""
    import importlib

    from dihal.stages.lm import models

    real = models.load_model
    for name in ("extract", "evaluate", "own_text", "lineage"):
        importlib.import_module(f"dihal.stages.{name}")
    stub = lambda *a, **k: pytest.fail("a model was loaded before the check")
    for module in [m for n, m in sys.modules.items() if n.startswith("dihal.") and m is not None]:
        if getattr(module, "load_model", None) is real:
            monkeypatch.setattr(module, "load_model", stub)


def load_script(name: str):
    """A module of scripts/ (not a package), loaded by path for a test of its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_tokenizer(bos: bool = True):
    """A 320-token byte-level BPE trained on pydoc topics. bos=False behaves as Qwen3's: no BOS,
    <|endoftext|> as the document separator (and pad), <|im_end|> as EOS."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<bos>", "<eos>"] if bos else ["<unk>", "<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:40]], trainer)
    if not bos:
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def tiny_config(kind: str, vocab: int, layers: int = 4):
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **common, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
        )
    if kind == "qwen3":  # as Qwen3: no BOS token; <|endoftext|> (id 1) pads, <|im_end|> (id 2) ends
        from transformers import Qwen3Config

        return Qwen3Config(**{**common, "bos_token_id": None, "pad_token_id": 1}, head_dim=8)
    raise ValueError(kind)


def build_tiny(kind: str, layers: int = 4, seed: int = 0):
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer(bos=kind != "qwen3")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, len(tok), layers)).eval()
    if kind == "gemma3":  # random init gives tiny embeddings; make the sqrt(d) scaling visible
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0, 1)
    return model, tok


def shared(tmp_path_factory, name: str, build) -> Path:
    """A session fixture's folder made once for all xdist workers, as xdist documents: the first worker to
    need it builds it under a file lock in the folder the workers share, the others wait and read it. A
    build that fails leaves no mark, so the next worker tries again. Without xdist, the session's own."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared-{name}"
    with FileLock(f"{path}.lock"):
        if not (path / ".built").exists():
            if path.exists():
                import shutil

                shutil.rmtree(path)
            path.mkdir()
            build(path)
            (path / ".built").touch()
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """{kind: local model directory} for llama, gemma3 and qwen3, shared by the workers."""
    kinds = ("llama", "gemma3", "qwen3")

    # named as tmp_path_factory.mktemp(f"tiny-{kind}") named them: a local model's folder name is its identity,
    # which the ids the golden records pin hash
    name = lambda kind: f"tiny-{kind}0"

    def build(folder: Path) -> None:
        for kind in kinds:
            model, tok = build_tiny(kind)
            model.save_pretrained(folder / name(kind))
            tok.save_pretrained(folder / name(kind))

    folder = shared(tmp_path_factory, "tiny", build)
    return {kind: folder / name(kind) for kind in kinds}


@pytest.fixture()
def root(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "runs"
    monkeypatch.setenv("DIHAL_ROOT", str(path))
    return path


def run_cli(
    *args: str, env: dict | None = None, check: bool = False, kill_after: int | None = None
) -> subprocess.CompletedProcess:
    """`dihal ARGS` in a fresh process, as a user runs it; kill_after=N: SIGKILL after N units of work."""
    full_env = {**os.environ, **(env or {})}
    entry = ["-m", "dihal.cli"] if kill_after is None else ["-m", "tests.kill_after", str(kill_after)]
    proc = subprocess.run([sys.executable, *entry, *args], capture_output=True, text=True, env=full_env, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"dihal {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


TMPFS_ENV = "DIHAL_TEST_TMPFS"  # "required": a full-disk test that cannot mount its tmpfs fails (scripts/test.sh)


def no_tmpfs(reason: str) -> None:
    """A full-disk test without its tmpfs: skipped, with why in the report, where mounting is not possible
    (no root); a failure where scripts/test.sh found that it is, so CI never skips it silently."""
    if os.environ.get(TMPFS_ENV) == "required":
        pytest.fail(f"{reason}, but {TMPFS_ENV}=required: this machine mounts tmpfs (scripts/test.sh checked)")
    pytest.skip(f"{reason}; run as root (CAP_SYS_ADMIN) to test a real full disk")


def torchrun(*args: str, ranks: int = 2, kill_after: int | None = None, timeout: float = 300):
    """`dihal ARGS` on `ranks` gloo ranks under torchrun, each rank's device written as cpu:<rank>
    (tests/rank_devices.py), one thread each; kill_after=N: rank 0 is SIGKILLed after N units of work.
    --standalone: torchrun binds a free port itself (a port picked here and released could be taken by another
    xdist worker's torchrun before this one binds it)."""
    entry = ["-m", "tests.rank_devices"] if kill_after is None else ["-m", "tests.kill_after", str(kill_after)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    command += [*entry, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


class Result:
    def __init__(self, exit_code: int, output: str):
        self.exit_code, self.output = exit_code, output


def invoke(*args: str) -> Result:
    """`dihal ARGS` in this process (fast); stdout and stderr together in .output."""
    from typer.testing import CliRunner

    from dihal.cli.main import app

    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    return Result(result.exit_code, result.output)


TINY_BRIDGE = ["--protocol", "sweep-tiny", "--width", "16", "--depth", "1", "--heads", "2", "--batch-size", "4"]


def _extract(tiny_dirs, *extra):
    return [
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--max-sequences",
        "8",
        "--seq-len",
        "16",
        "--device",
        "cpu",
        *extra,
    ]


# -- a small chain shared by the store tests ----------------------------------------------------------
@pytest.fixture(scope="session")
def chain_store(tiny_dirs, tmp_path_factory):
    """extract -> train-bridge (4 steps), made once per session for all workers; `chain` copies it."""

    def build(folder: Path) -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DIHAL_ROOT", str(folder / "runs"))
            args = _extract(tiny_dirs, "--layers", "0,2", "--max-sequences", "12", "--val-fraction", "0.25")
            assert invoke(*args).exit_code == 0
            res = invoke("train-bridge", "--layer", "2", "--extract", "latest", *TINY_BRIDGE, "--train-steps", "4")
            assert res.exit_code == 0, res.output

    return shared(tmp_path_factory, "chain", build) / "runs"


@pytest.fixture()
def chain(chain_store, root):
    """The session's chain copied into this test's fresh store; returns (store, extract, bridge)."""
    import shutil

    from dihal.artifacts.store import ArtifactStore

    shutil.copytree(chain_store, root)
    store = ArtifactStore(root)
    return store, store.resolve("latest", "extract"), store.resolve("latest", "bridge")

"""`dihal evaluate --bridge ID --lm-eval TASKS [--lm-eval-include DIR]`: lm-evaluation-harness scores the
hybrid (stages/hybrid_lm.py) and its original backbone on the same tasks, through the harness's own HFLM.

Like with like: both read their texts in windows of the bridge's positions (its extract's --seq-len; the
bridge has no position beyond), so a rolling perplexity is over the same windows for both. The harness is
an optional extra, `pip install 'dihal[eval]'`, pinned to the version the tests ran.
"""

from __future__ import annotations

import hashlib
import json
import traceback
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job
from dihal.stages.configs import HarnessConfig
from dihal.stages.runtime import dist
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "evaluate"
CACHE_VERSION = 2  # bump whenever this stage's bytes change (tests/test_golden.py says when); 2: whole result
BOOTSTRAP = 1000  # the harness's bootstrap draws for each metric's standard error (its default, 100000, takes minutes)
INSTALL = "pip install 'dihal[eval]'"


def harness():
    """The lm_eval package, or one line naming the install command."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (the model wrapper this stage uses)
    except ImportError:
        raise DihalError(f"--lm-eval needs lm-evaluation-harness, an optional extra; {INSTALL}") from None
    return lm_eval


def task_manager(cfg: HarnessConfig):
    """The harness's task index, every named task checked in it: --lm-eval-include's folder alone where every
    named task is one of its tasks (not a group or tag, which may name the harness's), else the harness's own
    tasks and the folder's. The harness's own index reads every YAML it ships: 6.7 s a build on one core here,
    against 0.05 s for a folder of two tasks (benchmarks/results/lm_eval_index.json)."""
    from lm_eval.tasks import TaskManager

    if cfg.include is not None and not Path(cfg.include).is_dir():
        raise DihalError(f"--lm-eval-include {cfg.include} is not a folder; give the folder of your task YAMLs")
    if cfg.include is not None:
        own = TaskManager(include_path=cfg.include, include_defaults=False)
        if set(cfg.tasks) <= set(own.all_subtasks):
            return own
    manager = TaskManager(include_path=cfg.include)
    known = set(manager.all_tasks)
    for task in cfg.tasks:
        if task not in known:
            where = f" or in {cfg.include}" if cfg.include else "; give --lm-eval-include DIR for your own YAMLs"
            raise DihalError(f"unknown lm-eval task '{task}': not among the harness's tasks{where}")
    return manager


def include_digest(folder: str | None) -> str | None:
    """sha256 over the folder's files (names and bytes): a changed task YAML or its data is a new artifact."""
    if folder is None:
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def run(
    cfg: HarnessConfig,
    bridge_art: Artifact,
    store: ArtifactStore,
    *,
    force: bool = False,
    progress: Progress | None = None,
    trust_remote_code: bool = False,
    manager=None,
) -> Artifact:
    """The tasks' metrics for the hybrid and the original (lm_eval.csv, lm_eval.json); manager: task_manager's
    for cfg, where the caller has built it already."""
    progress = progress or NullProgress()
    lm_eval = harness()
    manager = task_manager(cfg) if manager is None else manager
    config = harness_key(cfg)
    parents = {"bridge": bridge_art.id}

    def work(art: Artifact) -> None:
        from lm_eval.models.huggingface import HFLM

        from dihal.stages.hybrid_lm import HybridForCausalLM

        hybrid = HybridForCausalLM.from_bridge(
            bridge_art, cfg.device, cfg.dtype, cfg.sample_steps, cfg.seed, trust_remote_code
        )
        loaded = hybrid.loaded
        results = {}
        progress.start("lm-eval", 2, "model")
        for name, model in (("hybrid", hybrid), ("original", loaded.model)):
            lm = HFLM(
                pretrained=model,
                tokenizer=loaded.tokenizer,
                backend="causal",
                batch_size=cfg.batch_size,
                max_length=hybrid.positions,
            )
            out = _evaluate(
                lm_eval,
                hybrid.positions,
                model=lm,
                tasks=list(cfg.tasks),
                task_manager=manager,
                limit=cfg.limit,
                bootstrap_iters=BOOTSTRAP,
                num_fewshot=cfg.num_fewshot,
                log_samples=cfg.log_samples,
                random_seed=cfg.seed,
                numpy_random_seed=cfg.seed,
                torch_random_seed=cfg.seed,
                fewshot_random_seed=cfg.seed,
            )
            for task, rows in (out.pop("samples", None) or {}).items():  # --lm-eval-log-samples
                lines = "".join(json.dumps(row, default=str) + "\n" for row in rows)
                art.file(f"samples/{name}/{task}.jsonl").parent.mkdir(parents=True, exist_ok=True)
                art.file(f"samples/{name}/{task}.jsonl").write_text(lines)
            results[name] = out  # the harness's whole result: results, configs, versions, n-shot, n-samples, ...
            progress.advance(1)
        progress.stop()
        rows = table(results)
        pd.DataFrame(rows).to_csv(art.file("lm_eval.csv"), index=False)
        art.file("lm_eval.json").write_text(json.dumps(results, indent=1, default=str))
        art.manifest["metrics"] = {
            "lm_eval": rows,
            "harness_version": _version(),
            "max_length": hybrid.positions,
            "layer": hybrid.config.layer,
        }

    extra = {"model": bridge_art.manifest.get("model")}
    job = Job(STAGE, CACHE_VERSION, config, parents, work, seed=cfg.seed, device=cfg.device, extra=extra)
    return store.run_stage(job, force=force, progress=progress, group=dist.group())


def _evaluate(lm_eval, positions: int, **kwargs) -> dict:
    """lm_eval.simple_evaluate, with the harness's one assertion a bridge's length can trip made one line: a
    continuation longer than max_length (the hybrid's positions: a --positions learned bridge covers only its
    --seq-len) stops HFLM._loglikelihood_tokens with a bare AssertionError."""
    try:
        return lm_eval.simple_evaluate(**kwargs)
    except AssertionError as exc:
        if traceback.extract_tb(exc.__traceback__)[-1].name == "_loglikelihood_tokens":
            raise DihalError(
                f"a task's continuation is longer than the hybrid's {positions} positions, which the harness "
                "cannot score; a --positions learned bridge covers only its extract's --seq-len: use a rotary "
                "bridge (the default) or an extract with a longer --seq-len"
            ) from None
        raise


def harness_key(cfg: HarnessConfig) -> dict:
    """What an lm-eval artifact's id hashes: the flags, --lm-eval-include's files, and the harness's version,
    whose tasks (prompts, splits, metrics) an upgrade may change: an upgraded harness measures anew."""
    return {"kind": "lm_eval", **asdict(cfg), "include": include_digest(cfg.include), "harness": _version()}


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def table(results: dict) -> list[dict]:
    """One row per task and metric: the hybrid's and the original's value and standard error."""
    rows = []
    hybrid, original = results["hybrid"]["results"], results["original"]["results"]
    for task in sorted(hybrid):
        for key, value in hybrid[task].items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, (int, float)) or metric in ("alias", "sample_len"):
                continue
            stderr = f"{metric}_stderr,{filt}"
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "n": _number(hybrid[task].get("sample_len")),
                    "hybrid": float(value),
                    "hybrid_stderr": _number(hybrid[task].get(stderr)),
                    "original": float(original[task][key]),
                    "original_stderr": _number(original[task].get(stderr)),
                }
            )
    return rows


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None

"""`dihal evaluate --lm-eval` on a folder of one's own tasks: the task index built from that folder alone
(what stages/evaluate_harness.py task_manager builds when every named task is the folder's) against the
harness's whole index (every YAML it ships, and the folder's), which it built twice a command before. The
median of 3 builds each; the ratio is what to quote.

    python benchmarks/bench_lm_eval_index.py      # writes benchmarks/results/lm_eval_index.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, save  # noqa: E402

FOLDER = Path(__file__).resolve().parents[1] / "tests" / "data" / "lm_eval"


def main() -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    times: dict[str, list[float]] = {"the folder alone": [], "the harness's and the folder's": []}
    for _ in range(3):
        for name, defaults in (("the folder alone", False), ("the harness's and the folder's", True)):
            with Timer() as t:
                manager = TaskManager(include_path=str(FOLDER), include_defaults=defaults)
            times[name].append(t.seconds)
            assert {"dihal_pydoc_mc", "dihal_pydoc_ppl"} <= set(manager.all_subtasks)
    medians = {name: statistics.median(v) for name, v in times.items()}
    save(
        "lm_eval_index",
        {
            "harness": lm_eval.__version__,
            "folder": "tests/data/lm_eval (2 tasks)",
            "build_seconds": times,
            "median_seconds": medians,
            "whole_over_folder": medians["the harness's and the folder's"] / medians["the folder alone"],
        },
    )


if __name__ == "__main__":
    main()

"""Run `dihal ARGS` in this process with every model load taking SECONDS longer, as an 8B model's load
does: the window in which a second identical command once found no artifact, loaded, and then reopened
the artifact the first had completed meanwhile (issue 45).

    python -m tests.slow_load SECONDS ARGS...
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    delay, args = float(sys.argv[1]), sys.argv[2:]
    from dihal.stages.lm import models

    real = models.load_model

    def slow(*a, **k):
        time.sleep(delay)
        return real(*a, **k)

    import dihal.cli.main as cli

    for module in [m for n, m in list(sys.modules.items()) if n.startswith("dihal.") and m is not None]:
        if getattr(module, "load_model", None) is real:
            module.load_model = slow
    import importlib

    for name in ("extract", "evaluate", "own_text", "lineage"):  # the stages that bind it by name
        module = importlib.import_module(f"dihal.stages.{name}")
        if getattr(module, "load_model", None) is real:
            module.load_model = slow
    cli.app(args, prog_name="dihal")


if __name__ == "__main__":
    main()

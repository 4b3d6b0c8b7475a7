"""Run `dihal ARGS` in this process and SIGKILL it for real once the stage has reported N units of
completed work (committed chunks for extract, optimizer steps for training): resume tests use
it instead of any fault switch inside the library.

    python -m tests.kill_after N ARGS...
"""

from __future__ import annotations

import os
import signal
import sys

from dihal.cli import ui
from tests.rank_devices import patch


def main() -> None:
    patch()  # under torchrun each rank's device is cpu:<LOCAL_RANK>, as a GPU rank's is cuda:<LOCAL_RANK>
    after, args = int(sys.argv[1]), sys.argv[2:]
    done = {"n": 0}

    class KillingProgress(ui.PlainProgress):
        def advance(self, amount: float, **info: float) -> None:
            super().advance(amount, **info)
            done["n"] += 1
            if done["n"] == after:
                os.kill(os.getpid(), signal.SIGKILL)

    ui.make_progress = lambda: KillingProgress()
    import dihal.cli.main as cli

    cli.make_progress = ui.make_progress
    cli.app(args, prog_name="dihal")


if __name__ == "__main__":
    main()

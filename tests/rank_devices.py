"""Run `dihal ARGS` as a torchrun rank whose device carries its index, as a GPU rank's does.

Under torchrun on gloo every rank's device is plain `cpu`, so a test there cannot see an artifact
id that depends on the rank's device. On CUDA, `dist.join` gives rank r the device `cuda:<r>`;
this writes a CPU rank's device the same way, `cpu:<LOCAL_RANK>` (torch places `cpu:<r>` tensors
on the CPU), so the gloo tests exercise exactly what a GPU node runs.

    python -m tests.rank_devices ARGS...        (tests.kill_after applies the same patch)
    python -m tests.rank_devices --each FILE    every command of FILE (a JSON list of argument lists) in this
                                                one process, in order: one launch, not one per command
"""

from __future__ import annotations

import os
import sys


def patch() -> None:
    """Every rank of a world larger than one gets `cpu:<LOCAL_RANK>` where the CUDA path writes
    `cuda:<LOCAL_RANK>`; one process is left alone."""
    from dihal.stages.lm import models
    from dihal.stages.runtime import dist

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    joined, resolved = dist.join, models.resolve_device

    def join(device, *args, **kwargs):
        out = joined(device, *args, **kwargs)
        return f"cpu:{os.environ.get('LOCAL_RANK', '0')}" if out == "cpu" else out

    def resolve_device(device, *args, **kwargs):  # a `cpu:<r>` that reaches it is the rank's own device
        return device if device.startswith("cpu:") else resolved(device, *args, **kwargs)

    dist.join, models.resolve_device = join, resolve_device


def each(path: str) -> None:
    """Run each command of `path` as `dihal` would, stopping at the first that fails (with its exit code); rank
    0 appends a line per command to path + 'l': its exit code and every artifact of the store after it."""
    import json

    import dihal.cli.main as cli
    from dihal.artifacts.store import ArtifactStore

    for args in json.loads(open(path).read()):
        try:
            code = cli.app(args, prog_name="dihal", standalone_mode=False)
        except SystemExit as exc:
            code = exc.code
        if os.environ.get("RANK", "0") == "0":
            arts = ArtifactStore(args[args.index("--root") + 1]).all()
            with open(path + "l", "a") as out:
                out.write(json.dumps({"code": code, "made": [[a.stage, a.id] for a in arts]}) + "\n")
        if code:
            sys.exit(code)


def main() -> None:
    patch()
    import dihal.cli.main as cli

    if sys.argv[1:2] == ["--each"]:
        each(sys.argv[2])
    else:
        cli.app(sys.argv[1:], prog_name="dihal")


if __name__ == "__main__":
    main()

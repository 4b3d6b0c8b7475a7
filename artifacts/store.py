"""The versioned artifact store: where every stage output lives.

Layout (root = --root, default ./runs):

    <root>/<stage>/<id>/manifest.json   single source of truth (config, parents, status, metrics, and
                                        every file's size and sha256, recorded at completion)
    <root>/<stage>/<id>/...             the stage's files (Zarr groups, tables, weights, plots)
    <root>/<stage>/<id>.lock            held (flock) while a process writes the artifact

id = first 12 hex digits of sha256 over the canonical JSON of
{stage, schema version, resolved config, parent ids}; same inputs -> same id -> cache hit.
A manifest is always replaced through an atomic rename, and the status "complete" is the
last thing written; a complete artifact is never modified again. `verify` recomputes the
checksums; `remove` and `collect_garbage` delete artifacts (never one that has children, unless
asked, and never one a live process holds the lock of).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dihal.artifacts.errors import DihalError

SCHEMA_VERSION = 2  # 2: keyword configs (extract holds its data config), per-file checksums
DEFAULT_ROOT = "runs"
COMMANDS = {  # stage -> the `dihal` command that makes it
    "extract": "extract",
    "score": "score",
    "bridge": "train-bridge",
    "prior": "train-prior",
    "decoder": "train-decoder",
    "autoencoder": "train-autoencoder",
    "evaluate": "evaluate",
    "generate": "generate",
    "sweep": "sweep",
    "confirm": "confirm",
    "compare": "compare",
}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def artifact_id(stage: str, config: dict, parents: dict[str, str]) -> str:
    payload = {"stage": stage, "schema": SCHEMA_VERSION, "config": config, "parents": parents}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:12]


def resolve_root(root: str | os.PathLike | None = None) -> Path:
    return Path(root or DEFAULT_ROOT)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def _git_state() -> dict:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return {}
        return {"git_sha": sha.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {}


def environment(device: str | None = None) -> dict:
    """What ran: versions, the CPU threads (float sums, so sampled tokens, can differ with them), the
    process group's world size, the DIHAL_* settings (the torchrun timeout among them), and on a GPU
    its name, memory and the CUDA and NCCL versions."""
    env = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in ("torch", "transformers", "zarr", "numpy", "datasets"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing optional library is recorded as absent
            env[mod] = None
    if device is not None:
        env["device"] = device
    env["settings"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("DIHAL_")}
    if env["torch"] is not None:
        env.update(_torch_environment(device or ""))
    return env


def _torch_environment(device: str) -> dict:
    import torch

    env = {"threads": torch.get_num_threads(), "world_size": 1}
    group = torch.distributed
    if group.is_available() and group.is_initialized():
        env["world_size"] = group.get_world_size()
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError, TypeError):  # a build without NCCL
            env["nccl"] = None
    return env


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict:
    with open(path) as fh:
        return json.load(fh)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _payload_files(path: Path) -> list[Path]:
    return [
        p for p in sorted(path.rglob("*")) if p.is_file() and p.name != "manifest.json" and not p.name.endswith(".tmp")
    ]


@dataclass
class Artifact:
    """A handle on one artifact directory and its manifest."""

    root: Path
    stage: str
    id: str
    manifest: dict = field(default_factory=dict)
    reused: bool = False  # True when a stage returned this complete artifact instead of computing it

    @property
    def path(self) -> Path:
        return self.root / self.stage / self.id

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def config(self) -> dict:
        return self.manifest.get("config", {})

    @property
    def status(self) -> str:
        return self.manifest.get("status", "missing")

    @property
    def wall_seconds(self) -> float:
        """Seconds from start to finish of the run that completed it (NaN while unfinished)."""
        started, finished = self.manifest.get("started"), self.manifest.get("finished")
        if not started or not finished:
            return float("nan")
        return (_dt.datetime.fromisoformat(finished) - _dt.datetime.fromisoformat(started)).total_seconds()

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def file(self, name: str) -> Path:
        return self.path / name

    def save_manifest(self) -> None:
        write_json_atomic(self.manifest_path, self.manifest)

    def set_metrics(self, **metrics: Any) -> None:
        if self.complete:
            raise DihalError(f"artifact {self.stage}/{self.id} is complete and cannot be modified")
        self.manifest.setdefault("metrics", {}).update(metrics)
        self.save_manifest()

    def finish(self) -> None:
        """Record every file's size and sha256, then mark complete: the last write of an artifact."""
        files = {
            str(p.relative_to(self.path)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in _payload_files(self.path)
        }
        self.manifest["files"] = files
        self.manifest["size_bytes"] = sum(f["bytes"] for f in files.values())
        if (peak := peak_gpu_memory()) is not None:
            self.manifest["peak_gpu_memory_gib"] = peak
        self.manifest["finished"] = _now()
        self.manifest["status"] = "complete"
        self.save_manifest()

    def fail(self, message: str) -> None:
        self.manifest["status"] = "failed"
        self.manifest["error"] = message
        self.manifest["finished"] = _now()
        try:
            self.save_manifest()
        except OSError:  # the disk that failed the stage may not take the manifest either
            pass

    def verify(self) -> list[str]:
        """Problems found: 'missing F', 'altered F', 'unrecorded F'; empty when every recorded file
        is present with its recorded size and sha256."""
        if not self.complete:
            return [f"status is {self.status}, not complete"]
        recorded = self.manifest.get("files", {})
        problems = []
        for name, entry in recorded.items():
            path = self.path / name
            if not path.is_file():
                problems.append(f"missing {name}")
            elif path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
                problems.append(f"altered {name}")
        problems += [
            f"unrecorded {p.relative_to(self.path)}"
            for p in _payload_files(self.path)
            if str(p.relative_to(self.path)) not in recorded
        ]
        return problems


class ArtifactStore:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = resolve_root(root)

    def make_root(self) -> Path:
        """Create the root (a one-line error where it cannot be written)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if not os.access(self.root, os.W_OK):  # a read-only file system says so even to root
                raise OSError(errno.EROFS if os.statvfs(self.root).f_flag & os.ST_RDONLY else errno.EACCES, "")
        except OSError as exc:
            raise DihalError(f"cannot write under {self.root} ({_reason(exc)}); choose a writable --root") from None
        return self.root

    # -- lookup ---------------------------------------------------------------------------
    def load(self, stage: str, art_id: str) -> Artifact:
        art = Artifact(self.root, stage, art_id)
        if art.manifest_path.exists():
            art.manifest = read_json(art.manifest_path)
        return art

    def all(self, stage: str | None = None) -> list[Artifact]:
        stages = [stage] if stage else sorted(p.name for p in self.root.glob("*") if p.is_dir())
        arts = []
        for st in stages:
            for d in sorted((self.root / st).glob("*")):
                if d.is_dir() and (d / "manifest.json").exists():
                    arts.append(self.load(st, d.name))
        return sorted(arts, key=lambda a: a.manifest.get("created", ""))

    def resolve(self, ref: str, stage: str | None = None) -> Artifact:
        """An artifact by full id, unique id prefix, or 'latest' (newest complete one)."""
        candidates = [a for a in self.all(stage)]
        if ref == "latest":
            done = [a for a in candidates if a.complete]
            if not done:
                where = f"{stage} " if stage else ""
                command = COMMANDS.get(stage, stage) if stage else "extract"
                raise DihalError(f"no complete {where}artifact under {self.root}; run `dihal {command}` first")
            return done[-1]
        matches = [a for a in candidates if a.id.startswith(ref)]
        if not matches:
            kind = f"{stage} artifact" if stage else "artifact"
            raise DihalError(f"no {kind} '{ref}' under {self.root}; `dihal runs list` shows what exists")
        if len(matches) > 1:
            raise DihalError(
                f"'{ref}' matches {len(matches)} artifacts ({', '.join(a.id for a in matches)}); give more of the id"
            )
        return matches[0]

    def lineage(self, art: Artifact) -> list[Artifact]:
        chain, todo = [], list(art.manifest.get("parents", {}).items())
        while todo:
            stage, pid = todo.pop(0)
            stage = stage.split(":")[0]
            parent = self.load(stage, pid)
            chain.append(parent)
            todo.extend(parent.manifest.get("parents", {}).items())
        return chain

    def children(self, art: Artifact) -> list[Artifact]:
        return [a for a in self.all() if art.id in a.manifest.get("parents", {}).values()]

    def remove(self, art: Artifact, recursive: bool = False) -> list[Artifact]:
        """Delete art (and, with recursive, everything made from it); returns what was removed."""
        kids = self.children(art)
        if kids and not recursive:
            raise DihalError(
                f"{art.stage}/{art.id} has {len(kids)} children ({', '.join(f'{k.stage}/{k.id}' for k in kids[:3])}"
                f"{', ...' if len(kids) > 3 else ''}); pass --recursive to remove them too"
            )
        removed = []
        for kid in kids:
            removed += self.remove(kid, recursive=True)
        with self.lock(art.stage, art.id):
            shutil.rmtree(art.path)
        (self.root / art.stage / f"{art.id}.lock").unlink(missing_ok=True)
        return removed + [art]

    def collect_garbage(self, older_than_s: float, dry_run: bool = False) -> list[Artifact]:
        """Failed or incomplete artifacts created more than older_than_s ago and not locked by a live
        writer: removed (or only listed, with dry_run)."""
        cutoff = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(seconds=older_than_s)
        chosen = []
        for art in self.all():
            created = art.manifest.get("created")
            if art.complete or not created or _dt.datetime.fromisoformat(created) > cutoff:
                continue
            try:
                with self.lock(art.stage, art.id):
                    if not dry_run:
                        shutil.rmtree(art.path)
            except DihalError:  # a live process is writing it
                continue
            if not dry_run:
                (self.root / art.stage / f"{art.id}.lock").unlink(missing_ok=True)
            chosen.append(art)
        return chosen

    # -- creation -------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, stage: str, art_id: str) -> Iterator[None]:
        lock_path = self.root / stage / f"{art_id}.lock"
        try:
            (self.root / stage).mkdir(parents=True, exist_ok=True)
            fh = open(lock_path, "w")
        except OSError as exc:
            raise DihalError(f"cannot write under {self.root} ({_reason(exc)}); choose a writable --root") from None
        with fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DihalError(
                    f"another process is writing {stage}/{art_id} (lock {lock_path}); wait for it to finish"
                ) from None
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def begin(
        self,
        stage: str,
        config: dict,
        parents: dict[str, str],
        *,
        seed: int | None = None,
        device: str | None = None,
        extra: dict | None = None,
        force: bool = False,
    ) -> Artifact:
        """Open (or reopen, to resume) the artifact for this config; status 'running'.

        Callers check `cached` first; a complete artifact is only replaced with force=True.
        """
        art_id = artifact_id(stage, config, parents)
        art = self.load(stage, art_id)
        if art.complete and force:
            import shutil

            shutil.rmtree(art.path)
            art.manifest = {}
        art.path.mkdir(parents=True, exist_ok=True)
        previous = art.manifest
        art.manifest = {
            "stage": stage,
            "id": art_id,
            "schema_version": SCHEMA_VERSION,
            "dihal_version": _dihal_version(),
            **_git_state(),
            "config": config,
            "parents": parents,
            "environment": environment(device),
            "seed": seed,
            "status": "running",
            "created": previous.get("created", _now()),
            "started": _now(),
            "resumed": bool(previous),
            "metrics": {},
            **(extra or {}),
        }
        art.save_manifest()
        return art

    @contextlib.contextmanager
    def writing(
        self,
        stage: str,
        config: dict,
        parents: dict[str, str],
        *,
        force: bool = False,
        seed: int | None = None,
        device: str | None = None,
        extra: dict | None = None,
    ) -> Iterator[Artifact]:
        """Lock, open (status running), yield, then mark complete; a DihalError marks it failed."""
        with self.lock(stage, artifact_id(stage, config, parents)):
            try:
                art = self.begin(stage, config, parents, seed=seed, device=device, extra=extra, force=force)
            except OSError as exc:
                raise DihalError(f"cannot write under {self.root} ({_reason(exc)}); choose a writable --root") from None
            try:
                yield art
                art.finish()
            except DihalError as exc:
                art.fail(str(exc))
                raise
            except OSError as exc:  # out of disk, a read-only or vanished directory: keep what is complete
                message = (
                    f"writing {stage}/{art.id} failed ({_reason(exc)}); free space or fix {self.root}, "
                    "then rerun the same command to resume"
                )
                art.fail(message)
                raise DihalError(message) from None
            except RuntimeError as exc:
                if not out_of_gpu_memory(exc):
                    raise
                batch = config.get("batch_size")
                message = (
                    f"out of GPU memory in {COMMANDS.get(stage, stage)}{f' at batch {batch}' if batch else ''}; "
                    "lower --train-batch / --batch-size, then rerun the same command to resume"
                )
                art.fail(message)
                raise DihalError(message) from None

    def cached(self, stage: str, config: dict, parents: dict[str, str], *, force: bool = False) -> Artifact | None:
        """The complete artifact for this config and parents, or None (always None under --force)."""
        if force:
            return None
        art = self.load(stage, artifact_id(stage, config, parents))
        art.reused = art.complete
        return art if art.complete else None


def peak_gpu_memory() -> float | None:
    """GiB this process has held on its GPU at most so far (None where it never used one)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def out_of_gpu_memory(exc: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError (bad input like any other: the batch did not fit the GPU)."""
    return type(exc).__name__ == "OutOfMemoryError" and type(exc).__module__.startswith("torch")


def _reason(exc: OSError) -> str:
    name = {
        errno.ENOSPC: "no space left on device",
        errno.EROFS: "read-only file system",
        errno.EACCES: "permission denied",
        errno.EDQUOT: "disk quota exceeded",
    }.get(exc.errno)
    return name or exc.strerror or type(exc).__name__


def _dihal_version() -> str:
    try:
        from importlib.metadata import version

        return version("dihal")
    except Exception:  # noqa: BLE001 - running from a source tree without install
        return "0+unknown"

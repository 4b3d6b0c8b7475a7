"""The versioned artifact store: where every stage output lives, and the one way a stage runs.

Layout (root = --root, default ./runs):

    <root>/<stage>/<id>/manifest.json   single source of truth (config, parents, status, metrics, every
                                        file's size and sha256 recorded at completion, and a digest of
                                        the manifest itself)
    <root>/<stage>/<id>/...             the stage's files (Zarr groups, tables, weights, plots)
    <root>/<stage>/<id>.lock            held (flock) while a process writes the artifact

id = first 12 hex digits of sha256 over the canonical JSON of {stage, schema version, resolved config
(with the stage's CACHE_VERSION), parent ids}; same inputs and code -> same id -> cache hit.

Every stage runs through `ArtifactStore.run_stage(job)`: plan -> lock -> check the cache again under
the lock -> write -> record checksums -> complete. A manifest is replaced through an atomic rename and
"complete" is the last thing written; a complete artifact is never modified again. Every read of a
complete artifact's file goes through `Artifact.file`, which checks the file's sha256 against the
manifest first (once per process); Zarr chunks are checked the same way (hidden_states.open_group).
A manifest that is not JSON, or whose digest or id does not match its content, reads as "corrupt".
`verify` recomputes every checksum; `remove` and `collect_garbage` delete artifacts (never one that has
children, unless asked, and never one a live process holds the lock of).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dihal.artifacts.errors import DihalError

SCHEMA_VERSION = 3  # 2: keyword configs, per-file checksums; 3: CACHE_VERSION in every key, manifest digest
DEFAULT_ROOT = "runs"
STRICT_ENV = "DIHAL_STRICT_CACHE"  # "1": a cache hit made by other code is recomputed (--strict-cache)
RESERVE = ".reserve"  # beside a running manifest: freed first to record a failure on a full disk
RESERVE_BYTES = 1 << 16  # a failed manifest is a few KiB
SCRATCH = ("state.safetensors", RESERVE)  # resume state and the reserve: never recorded, removed once complete
UNFINISHED = (".tmp", ".partial")  # a write cut short (ours, and Zarr's atomic writes): never recorded
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


def artifact_id(stage: str, config: dict, parents: dict[str, str], schema: int = SCHEMA_VERSION) -> str:
    payload = {"stage": stage, "schema": schema, "config": config, "parents": parents}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:12]


def keyed(config: dict, version: int) -> dict:
    """What an artifact id hashes: the stage's resolved config with its CACHE_VERSION."""
    return {**config, "cache_version": version}


@dataclass(frozen=True)
class Job:
    """One stage computation, as `ArtifactStore.run_stage` runs it (the small Stage protocol).

    stage, version   the stage's name and CACHE_VERSION (bumped whenever its bytes change)
    config, parents  what the id hashes besides the version: the resolved config, the parents' ids
    work(art)        writes the artifact's files and metrics into the running `art`
    plan()           the checks worth making before the lock (no cache hit yet); may raise DihalError
    every_rank       under torchrun, work runs on every rank (it splits itself); else on rank 0 alone,
                     the other ranks wait for its artifact and return it
    """

    stage: str
    version: int
    config: dict
    parents: dict
    work: Callable[[Artifact], None] | None = None
    plan: Callable[[], None] | None = None
    seed: int | None = None
    device: str | None = None
    extra: dict = field(default_factory=dict)
    every_rank: bool = False

    @property
    def key(self) -> dict:
        return keyed(self.config, self.version)

    @property
    def id(self) -> str:
        return artifact_id(self.stage, self.key, self.parents)


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


def unfinished(path: Path) -> bool:
    """A file a cut-short write left behind (ours end in .tmp, Zarr's in .<uuid>.partial)."""
    return path.name.endswith(UNFINISHED)


def _payload_files(path: Path) -> list[Path]:
    return [
        p
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "manifest.json" and not unfinished(p) and p.name not in SCRATCH
    ]


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without its own digest: any edit to a complete
    manifest (its config, its file list, its metrics) shows."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != "digest"}).encode()).hexdigest()


def corruption(stage: str, art_id: str, manifest: dict) -> str | None:
    """Why a complete manifest cannot be trusted, or None: its digest or its id does not match its content."""
    if "digest" in manifest and manifest["digest"] != manifest_digest(manifest):
        return "its manifest was edited after completion (digest mismatch)"
    if "config" in manifest and "parents" in manifest and manifest.get("schema_version", 0) >= 2:
        schema = manifest["schema_version"]
        if artifact_id(stage, manifest["config"], manifest["parents"], schema) != art_id:
            return "its manifest's config does not hash to its id"
    return None


_VERIFIED: dict[tuple, str] = {}  # file_state(path) -> sha256 checked in this process


def file_state(path: Path | str, st: os.stat_result) -> tuple:
    """What identifies a file's bytes without reading them: its size, inode and both times. The ctime is the
    kernel's, set by every write and by every utime, so an edit whose mtime was put back still shows (git's
    index does the same)."""
    return (str(path), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def check_file(path: Path, entry: dict, where: str) -> None:
    """path holds the bytes recorded in `entry` ({bytes, sha256}); once per process per file state."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DihalError(f"{path} is missing from {where}; `dihal runs verify` lists what else is") from None
    key = file_state(path, st)
    if _VERIFIED.get(key) == entry["sha256"]:
        return
    if st.st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
        raise DihalError(
            f"{path} does not match the checksum {where} recorded at completion (corrupt or edited); "
            "`dihal runs verify` lists what else is, rerun the stage that made it with --force"
        )
    _VERIFIED[key] = entry["sha256"]


@functools.lru_cache(maxsize=1)
def code_identity() -> dict:
    """The code this process runs: dihal's version and, from a checkout, its git commit."""
    return {"dihal_version": _dihal_version(), **_git_state()}


def other_code(manifest: dict) -> str | None:
    """How the code that made an artifact differs from this process's, or None when it is the same
    (the version, and the commit where both know one)."""
    now, then = code_identity(), manifest
    if then.get("dihal_version") != now["dihal_version"]:
        return f"made by dihal {then.get('dihal_version')} (this is {now['dihal_version']})"
    if now.get("git_sha") and then.get("git_sha") and then["git_sha"] != now["git_sha"]:
        return f"made by other code (git {then['git_sha'][:10]}, this is {now['git_sha'][:10]})"
    return None


def strict_cache() -> bool:
    return os.environ.get(STRICT_ENV, "0") == "1"


@dataclass
class Artifact:
    """A handle on one artifact directory and its manifest."""

    root: Path
    stage: str
    id: str
    manifest: dict = field(default_factory=dict)
    reused: bool = False  # True when a stage returned this complete artifact instead of computing it
    other_code: str | None = None  # on a cache hit: how the code that made it differs from this one's
    previous: dict = field(default_factory=dict)  # the manifest a resumed run found (its earlier attempt's)

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
        """complete, running, failed, corrupt, or 'no manifest' for a folder a kill left before one."""
        if not self.manifest:
            return "no manifest" if self.path.is_dir() else "missing"
        return self.manifest.get("status", "corrupt")

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
        """The path of one of the artifact's files. Of a complete artifact, a file is returned only
        once its bytes match the manifest (a one-line error otherwise); a missing recorded file is an
        error, an absent unrecorded one (an optional output) is not."""
        path = self.path / name
        if self.complete and "files" in self.manifest:
            entry = self.manifest["files"].get(name)
            if entry is not None:
                check_file(path, entry, f"{self.stage}/{self.id}")
            elif path.is_file():
                raise DihalError(
                    f"{path} is not among the files {self.stage}/{self.id} recorded at completion; "
                    f"`dihal runs verify {self.id}` lists what else is"
                )
        return path

    def save_manifest(self) -> None:
        write_json_atomic(self.manifest_path, self.manifest)

    def set_metrics(self, **metrics: Any) -> None:
        if self.complete:
            raise DihalError(f"artifact {self.stage}/{self.id} is complete and cannot be modified")
        self.manifest.setdefault("metrics", {}).update(metrics)
        self.save_manifest()

    def finish(self) -> None:
        """Record every file's size and sha256 and the manifest's digest, then mark complete (the last
        write of an artifact); a part's resume state goes only after that, so a kill in between
        loses no training."""
        files = {
            p.relative_to(self.path).as_posix(): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in _payload_files(self.path)
        }
        self.manifest["files"] = files
        self.manifest["size_bytes"] = sum(f["bytes"] for f in files.values())
        if (peak := peak_gpu_memory()) is not None:
            self.manifest["peak_gpu_memory_gib"] = peak
        self.manifest["finished"] = _now()
        self.manifest["status"] = "complete"
        self.manifest.pop("digest", None)
        self.manifest = json.loads(json.dumps(self.manifest, default=str))  # as it reads back (str keys)
        self.manifest["digest"] = manifest_digest(self.manifest)
        self.save_manifest()
        self.clean_scratch()

    def clean_scratch(self) -> None:
        """Remove what a complete artifact no longer needs: resume state and cut-short writes."""
        for p in [q for q in self.path.rglob("*") if q.is_file() and (q.name in SCRATCH or unfinished(q))]:
            if p != self.manifest_path:
                p.unlink(missing_ok=True)

    def fail(self, message: str) -> None:
        (self.path / RESERVE).unlink(missing_ok=True)  # on a full disk, the room the manifest needs
        self.manifest["status"] = "failed"
        self.manifest["error"] = message
        self.manifest["finished"] = _now()
        try:
            self.save_manifest()
        except OSError:  # the disk that failed the stage may not take the manifest either
            pass

    def verify(self) -> list[str]:
        """Problems found: 'missing F', 'altered F', 'unrecorded F', a corrupt manifest; empty when
        every recorded file is present with its recorded size and sha256."""
        if not self.complete:
            reason = f" ({self.manifest['error']})" if self.status == "corrupt" and "error" in self.manifest else ""
            return [f"status is {self.status}{reason}, not complete"]
        recorded = self.manifest.get("files", {})
        problems = []
        for name, entry in recorded.items():
            path = self.path / name
            if not path.is_file():
                problems.append(f"missing {name}")
            elif path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
                problems.append(f"altered {name}")
        problems += [
            f"unrecorded {p.relative_to(self.path).as_posix()}"
            for p in _payload_files(self.path)
            if p.relative_to(self.path).as_posix() not in recorded
        ]
        return problems


def _read_manifest(art: Artifact) -> dict:
    """The manifest, or a stand-in whose status is 'corrupt' (not JSON, edited, hashing to another id)."""
    try:
        manifest = read_json(art.manifest_path)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return {"status": "corrupt", "error": f"manifest.json is unreadable ({type(exc).__name__})"}
    if not isinstance(manifest, dict):
        return {"status": "corrupt", "error": "manifest.json is not a JSON object"}
    if manifest.get("status") == "complete" and (why := corruption(art.stage, art.id, manifest)):
        return {**manifest, "status": "corrupt", "error": why}
    return manifest


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
        art.manifest = _read_manifest(art)
        return art

    def all(self, stage: str | None = None) -> list[Artifact]:
        """Every artifact folder, those without a manifest (a kill before the first write) included."""
        stages = [stage] if stage else sorted(p.name for p in self.root.glob("*") if p.is_dir())
        arts = [self.load(st, d.name) for st in stages for d in sorted((self.root / st).glob("*")) if d.is_dir()]
        return sorted(arts, key=lambda a: a.manifest.get("created") or _iso(_mtime(a.path)))

    def resolve(self, ref: str, stage: str | None = None, *, corrupt_ok: bool = False) -> Artifact:
        """An artifact by full id, unique id prefix, or 'latest' (newest complete one). A corrupt one is
        refused with one line (unless corrupt_ok, for `runs show` and `runs verify`)."""
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
        if matches[0].status == "corrupt" and not corrupt_ok:
            raise corrupt_error(matches[0])
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
        """Failed, incomplete, corrupt and manifest-less artifacts older than older_than_s and not locked
        by a live writer: removed (or only listed, with dry_run). The age of a folder without a
        manifest is its modification time."""
        cutoff = time.time() - older_than_s
        chosen = []
        for art in self.all():
            created = art.manifest.get("created")
            made = _dt.datetime.fromisoformat(created).timestamp() if created else _mtime(art.path)
            if art.complete or made > cutoff:
                continue
            art.manifest.setdefault("status", art.status)  # what it was, once its folder is gone
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
    def lock(self, stage: str, art_id: str, wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Hold the artifact's lock. Without `wait`, a lock another process holds is a one-line
        error; with it, wait(message) is called once and the lock is waited for."""
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
                message = f"another process is writing {stage}/{art_id} (lock {lock_path})"
                if wait is None:
                    raise DihalError(f"{message}; wait for it to finish") from None
                wait(f"{message}: waiting for it")
                fcntl.flock(fh, fcntl.LOCK_EX)
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
        """Open (or reopen, to resume) the artifact for this config; status 'running'. The caller holds
        the lock (run_stage does); a complete artifact is only replaced with force=True. A resumed
        run's cut-short writes are removed first; `art.previous` is the manifest it found."""
        art_id = artifact_id(stage, config, parents)
        art = self.load(stage, art_id)
        if art.complete and not force:
            raise DihalError(f"{stage}/{art_id} is complete; pass --force to recompute it")
        if force or art.status == "corrupt":
            shutil.rmtree(art.path, ignore_errors=True)
            art.manifest = {}
        if art.path.is_dir():
            for p in [q for q in art.path.rglob("*") if q.is_file() and unfinished(q)]:
                p.unlink(missing_ok=True)
        art.path.mkdir(parents=True, exist_ok=True)
        (art.path / RESERVE).write_bytes(b"\0" * RESERVE_BYTES)  # so that a full disk can still say "failed"
        previous = art.manifest
        art.previous = previous
        art.manifest = {
            "stage": stage,
            "id": art_id,
            "schema_version": SCHEMA_VERSION,
            **code_identity(),
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

    def cached(self, job: Job, *, force: bool = False) -> Artifact | None:
        """The complete artifact of this job, or None (always None under --force, and under
        --strict-cache for one made by other code). A corrupt one is a one-line error."""
        if force:
            return None
        art = self.load(job.stage, job.id)
        if art.status == "corrupt":
            raise corrupt_error(art)
        if not art.complete:
            return None
        art.other_code = other_code(art.manifest)
        if art.other_code and strict_cache():
            return None
        art.reused = True
        return art

    def run_stage(self, job: Job, *, force: bool = False, progress=None, group=None) -> Artifact:
        """Run one stage computation: plan -> lock -> cache check again under the lock -> work ->
        checksums -> complete. A second identical command waits for the first and returns its
        artifact; it never reopens a complete one. A failure marks the artifact failed with its
        one-line reason (its complete files stay, the same command resumes).

        group: the torchrun process group (stages.runtime.dist.group()), None for one process."""
        log = progress.log if progress is not None else (lambda message: print(message, file=sys.stderr))
        if group is not None and group.rank != 0:
            return self._follow(job, group)
        said = []  # what rank 0 told the other ranks: hit, work or wait (then done or error), or error

        def tell(*word):
            said.append(word[0])
            if group is not None:
                group.broadcast(word)

        try:
            if (hit := self._hit(job, force, None)) is not None:
                tell("hit")
                return hit
            if job.plan is not None:
                job.plan()
            self.make_root()
            with self.lock(job.stage, job.id, wait=log):
                if (hit := self._hit(job, force, log)) is not None:
                    tell("hit")
                    return hit
                replace = force or self.load(job.stage, job.id).complete  # --force, or --strict-cache
                try:
                    art = self.begin(
                        job.stage,
                        job.key,
                        job.parents,
                        seed=job.seed,
                        device=job.device,
                        extra=job.extra,
                        force=replace,
                    )
                except OSError as exc:
                    fix = (
                        "free space, then rerun"
                        if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                        else "choose a writable --root"
                    )
                    raise DihalError(f"cannot write under {self.root} ({_reason(exc)}); {fix}") from None
                tell("work" if job.every_rank and group is not None else "wait")
                solo = group.solo() if group is not None and not job.every_rank else contextlib.nullcontext()
                with failing(art):
                    if job.work is not None:
                        with solo:  # rank 0's own work runs as one process (its inner stages too)
                            job.work(art)
                    if group is not None and job.every_rank:
                        group.barrier()  # every rank's share is written
                    art.finish()
        except BaseException as exc:
            if not said or said == ["wait"]:  # the others wait for a word (after "work" torchrun ends them)
                tell("error", str(exc) if isinstance(exc, DihalError) else f"rank 0 failed ({type(exc).__name__})")
            raise
        tell("done")
        return art

    def _hit(self, job: Job, force: bool, log) -> Artifact | None:
        """The cache hit, if any (log: say why a strict cache recomputes, or whose code made a hit)."""
        hit = self.cached(job, force=force)
        if hit is not None:
            if hit.other_code and log is not None:
                log(f"cache hit {job.stage}/{job.id} {hit.other_code}; --strict-cache recomputes it")
            hit.clean_scratch()  # a kill between completion and the resume state's removal left it
            return hit
        found = self.load(job.stage, job.id)
        if log is not None and not force and found.complete:
            log(f"recomputing {job.stage}/{job.id}: {other_code(found.manifest)}, and --strict-cache is on")
        return None

    def _follow(self, job: Job, group) -> Artifact:
        """A rank other than 0: do what rank 0 says, and return the artifact it completed."""
        word = group.broadcast(None)
        if word[0] == "work":
            job.work(self.load(job.stage, job.id))
            group.barrier()
        if word[0] in ("work", "wait"):
            word = group.broadcast(None)
        if word[0] == "error":
            raise DihalError(word[1])
        art = self.load(job.stage, job.id)
        art.reused = word[0] == "hit"
        return art


def corrupt_error(art: Artifact) -> DihalError:
    return DihalError(
        f"{art.stage}/{art.id} is corrupt ({art.manifest.get('error', 'unreadable manifest')}); rerun the "
        f"command that made it with --force, or remove it with `dihal runs rm {art.id}`"
    )


@contextlib.contextmanager
def failing(art: Artifact) -> Iterator[None]:
    """Inside, any failure marks `art` failed with a one-line reason: a DihalError as it is, an OSError
    (a full disk, a read-only or vanished directory) and CUDA out of memory as one line naming the fix;
    anything else (a bug) is recorded and raised as it is."""
    stage, command = art.stage, COMMANDS.get(art.stage, art.stage)
    try:
        yield
    except DihalError as exc:
        art.fail(str(exc))
        raise
    except OSError as exc:  # out of disk, a read-only or vanished directory: keep what is complete
        message = (
            f"writing {stage}/{art.id} failed ({_reason(exc)}); free space or fix {art.root}, "
            "then rerun the same command to resume"
        )
        art.fail(message)
        raise DihalError(message) from None
    except RuntimeError as exc:
        if not out_of_gpu_memory(exc):
            art.fail(f"{type(exc).__name__}: {exc}")
            raise
        batch = art.config.get("batch_size")
        message = (
            f"out of GPU memory in {command}{f' at batch {batch}' if batch else ''}; "
            "lower --train-batch / --batch-size, then rerun the same command to resume"
        )
        art.fail(message)
        raise DihalError(message) from None
    except BaseException as exc:  # a bug or an interrupt: recorded, then raised as it is
        art.fail(f"{type(exc).__name__}: {exc}"[:500])
        raise


def _iso(seconds: float) -> str:
    return _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc).isoformat(timespec="microseconds")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


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

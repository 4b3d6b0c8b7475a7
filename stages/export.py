"""`dihal export` / `dihal import`: a trained bridge as a package that leaves its store, as a PEFT adapter or a
SAELens release does (docs/sharing.md). The package holds the bridge alone, never a backbone tensor:

    config.json           the hybrid's transformers config (model_type dihal_hybrid): the base model by name,
                          hub id and revision and the sha256 of its weights and tokenizer, the layer, the
                          sampling defaults, the extract's seq-len and start-token rule, the denoiser's shape,
                          the artifact's id and the sha256 of every other file here
    bridge.safetensors    the denoiser's EMA weights (what the hybrid samples with)
    stats.safetensors     the normalisation statistics and the stored position-0 state
    tokenizer files       the base model's tokenizer, so transformers' tools that read one find it
    dihal_manifest.json   the bridge artifact's manifest, absolute paths cut to their last part
    metrics.jsonl, loss_curve.png   its training log and curve
    README.md             the model card (library_name: dihal, base_model, protocol, the store's results)

A package is read only after every file it lists matches its sha256; a base model is used only when the
sha256 of its weights and tokenizer is the one the package names (check_base=False skips that, and says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job, file_sha256, write_json_atomic
from dihal.stages.lm import tokens
from dihal.stages.lm.models import BUILTINS, cache_dir, locate
from dihal.stages.runtime import hub

FORMAT = 1  # the package layout's version; a newer one is refused by name
CONFIG, WEIGHTS, STATS, MANIFEST = "config.json", "bridge.safetensors", "stats.safetensors", "dihal_manifest.json"
CARD = "README.md"
LOG_FILES = ("metrics.jsonl", "loss_curve.png")  # copied from the artifact where it has them
VOCABULARY = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "spiece.model", "vocab.txt")
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")  # the first that matches is what from_pretrained loads
PAPER = "DiHAL (arXiv 2605.14368)"


# -- the base model's content hash ---------------------------------------------------------------------------
def cached_sha256(path: Path) -> str:
    """sha256 of a file, remembered under $DIHAL_CACHE/hashes.json by (real path, size, mtime): an 8B
    model's 16 GB are hashed once per machine, not at every load."""
    real = Path(path).resolve()
    st = real.stat()
    book_path = cache_dir() / "hashes.json"
    try:
        book = json.loads(book_path.read_text())
    except (OSError, ValueError):
        book = {}
    key = f"{real}|{st.st_size}|{st.st_mtime_ns}"
    if key not in book:
        book[key] = file_sha256(real)
        try:
            book_path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(book_path, book)
        except OSError:  # a read-only cache: hash again next time
            pass
    return book[key]


def folder_sha256(folder: Path) -> str:
    """sha256 over the weights from_pretrained loads from `folder` (its *.safetensors, else *.bin, ...)
    and its vocabulary files, by name: the base model's content, whatever path or hub cache holds it."""
    weights = next((files for pattern in WEIGHT_GLOBS if (files := sorted(folder.glob(pattern)))), [])
    if not weights:
        raise DihalError(f"{folder} holds no weights (*.safetensors or *.bin); give the base model's directory")
    digest = hashlib.sha256()
    for path in weights + [folder / n for n in VOCABULARY if (folder / n).is_file()]:
        digest.update(f"{path.name}\0{cached_sha256(path)}\n".encode())
    return digest.hexdigest()


def model_folder(where, identity: dict) -> Path:
    """The folder from_pretrained reads for a located model (a hub model's snapshot in the HF cache)."""
    if identity["source"] != "hub":
        return Path(where)
    from huggingface_hub import snapshot_download

    revision = identity.get("revision")
    try:
        return Path(snapshot_download(str(where), revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache, in whatever way huggingface_hub says so
        pass
    if not hub.reachable():
        raise DihalError(
            f"model '{where}' is not in the local Hugging Face cache and the hub cannot be reached, so its weights "
            "cannot be hashed; load it once online (any dihal command with --model)"
        )
    patterns = [*WEIGHT_GLOBS, *VOCABULARY, "*.json"]  # what from_pretrained reads: the same download
    return Path(snapshot_download(str(where), revision=revision, allow_patterns=patterns))


def base_sha256(where, identity: dict) -> str:
    """The content hash of a base model: a builtin's or a .gguf's file sha256 (it holds the weights and
    the tokenizer), else the folder's (folder_sha256)."""
    if identity.get("file_sha256"):
        return identity["file_sha256"]
    folder = model_folder(where, identity)
    source = folder / "dihal_source.json"  # a converted GGUF in dihal's cache: the GGUF's hash
    if source.is_file():
        return json.loads(source.read_text())["sha256"]
    return folder_sha256(folder)


def spec_sha256(spec: str, revision: str | None = None) -> str:
    where, identity = locate(spec)
    return base_sha256(where, {**identity, "revision": revision})


def loaded_sha256(model) -> str:
    """The content hash of a model loaded in memory, from the files its name_or_path names."""
    name = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", ""))
    if name and Path(name).is_dir():
        return base_sha256(Path(name), {"source": "local"})
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return base_sha256(name, {"source": "hub", "revision": getattr(model.config, "_commit_hash", None)})
    raise DihalError(
        "the base model given in memory names no files to hash (its name_or_path is "
        f"'{name}'); pass its directory or hub id as base_model, or check_base=False"
    )


# -- writing -------------------------------------------------------------------------------------------------
def public(value):
    """A manifest as it may leave the machine: absolute paths cut to their last part."""
    if isinstance(value, dict):
        return {k: public(v) for k, v in value.items()}
    if isinstance(value, list):
        return [public(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return Path(value).name
    return value


def base_descriptor(art: Artifact) -> dict:
    """What the package says of its base model: name, source, hub id and revision, shape and content hash."""
    ex = art.manifest.get("extract_config") or {}
    spec, model = ex.get("model"), dict(art.manifest.get("model") or {})
    where, identity = locate(spec)
    identity["revision"] = model.get("revision") or ex.get("revision")
    hub_id = spec if identity["source"] == "hub" else None
    return {
        "name": model.get("name") or identity.get("name"),
        "source": identity["source"],
        "hub_id": hub_id,
        "revision": identity["revision"],
        "sha256": base_sha256(where, identity),
        **{k: model.get(k) for k in ("architecture", "num_blocks", "width", "vocab_size")},
    }


@dataclass(frozen=True)
class Results:
    """What the store holds about a bridge for its model card: fidelity rows and lm-eval rows."""

    fidelity: list
    lm_eval: list


def results_for(store: ArtifactStore, art: Artifact) -> Results:
    fidelity, harness = [], []
    for child in store.children(art):
        if child.stage != "evaluate" or not child.complete:
            continue
        metrics = child.manifest.get("metrics", {})
        if child.config.get("kind") == "fidelity":
            source = metrics.get("source", "validation")
            fidelity += [{"source": source, **row} for row in metrics.get("fidelity", [])]
        elif child.config.get("kind") == "lm_eval":
            harness += metrics.get("lm_eval", [])
    return Results(fidelity, harness)


def package_config(art: Artifact, bridge_meta: dict, base: dict, tokenizer, steps: int, seed: int) -> dict:
    """config.json: the hybrid's transformers config plus everything a loader needs."""
    ex = art.manifest.get("extract_config") or {}
    start_id, rule = tokens.start_token(tokenizer)
    den = bridge_meta["denoiser"]
    covered = den["max_len"] if den.get("positions", "learned") == "learned" else None
    return {
        "model_type": "dihal_hybrid",
        "architectures": ["HybridForCausalLM"],
        "dihal_format": FORMAT,
        "bridge": art.id,
        "layer": bridge_meta["layer"],
        "steps": steps,
        "seed": seed,
        "start": bridge_meta["start"],
        "prediction": bridge_meta["prediction"],
        "denoiser": den,
        "base": base,  # not "base_model": AutoModelForCausalLM would set that attribute from base_model=
        "extract": {
            "seq_len": (ex.get("data") or {}).get("seq_len"),
            "start_token": {"id": start_id, "rule": rule},
            "dataset": public((ex.get("data") or {}).get("dataset")),
        },
        "artifact": {"stage": art.stage, "id": art.id, "config": art.config, "parents": art.manifest["parents"]},
        "vocab_size": base.get("vocab_size"),
        "hidden_size": base.get("width"),
        "max_position_embeddings": None if covered is None else covered + bridge_meta["start"],
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def write(out: Path, art: Artifact, tokenizer, *, steps: int, seed: int, results: Results | None = None) -> Path:
    """Export a complete bridge artifact to `out` (a new or empty folder)."""
    meta = json.loads(art.file("bridge.json").read_text())
    base = base_descriptor(art)

    def fill(tmp: Path) -> None:
        shutil.copyfile(art.file("weights_ema.safetensors"), tmp / WEIGHTS)
        shutil.copyfile(art.file("stats.safetensors"), tmp / STATS)
        for name in LOG_FILES:
            if name in art.manifest.get("files", {}):
                shutil.copyfile(art.file(name), tmp / name)
        tokenizer.save_pretrained(tmp)
        manifest = public(art.manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        config = package_config(art, meta, base, tokenizer, steps, seed)
        (tmp / CARD).write_text(model_card(config, manifest, results or Results([], [])))
        config["files"] = {p.name: file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))

    return _publish(Path(out), fill)


def export_bridge(
    art: Artifact, out: Path, store: ArtifactStore, *, steps: int, seed: int, trust_remote_code: bool = False
) -> Path:
    """`dihal export`: a complete bridge artifact with the store's results for it, its base model's tokenizer
    loaded alone (no weights)."""
    from dihal.stages.lm.models import load_tokenizer

    if not art.complete:
        raise DihalError(f"bridge/{art.id} is {art.status}; finish it with the command that made it, then export")
    ex = art.manifest.get("extract_config") or {}
    tokenizer = load_tokenizer(ex.get("model"), (art.manifest.get("model") or {}).get("revision"), trust_remote_code)
    return write(out, art, tokenizer, steps=steps, seed=seed, results=results_for(store, art))


def copy(package: Package, out: Path, *, steps: int, seed: int) -> Path:
    """A package exported again (a hybrid loaded from one, saved): its files, its sampling defaults updated."""

    def fill(tmp: Path) -> None:
        for path in package.path.iterdir():
            if path.is_file() and not path.name.startswith("."):
                shutil.copyfile(path, tmp / path.name)
        config = {**package.config, "steps": steps, "seed": seed}
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))

    return _publish(Path(out), fill)


def _publish(out: Path, fill) -> Path:
    """fill(folder) writes a package beside `out`, which is then renamed to it: an interrupted export
    leaves no half package. `out` must be new or empty."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DihalError(f"{out} exists and is not empty; export into a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fill(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- the model card ------------------------------------------------------------------------------------------
def model_card(config: dict, manifest: dict, results: Results) -> str:
    """README.md: huggingface_hub's card metadata (library_name, base_model, tags) over dihal's text."""
    from huggingface_hub import ModelCard, ModelCardData

    base = config["base"]
    quantized = BUILTINS.get(base["name"], {}).get("hub") if base["source"] == "builtin" else None
    data = ModelCardData(
        library_name="dihal",
        base_model=base["hub_id"] or quantized,
        pipeline_tag="text-generation",
        tags=["dihal", "diffusion", "hybrid", f"layer-{config['layer']}"],
    )
    cfg, metrics = manifest.get("config", {}), manifest.get("metrics", {})
    protocol = ", ".join(
        f"{k} {cfg[k]}"
        for k in ("protocol", "steps", "batch_size", "lr", "width", "depth", "heads", "positions", "prediction")
        if k in cfg
    )
    base_name = base["hub_id"] or f"{base['name']} ({base['source']})"
    described = f"{base['name']} (dihal's builtin: {quantized} as a GGUF, de-quantized)" if quantized else base_name
    lines = [
        f"# DiHAL bridge: {base['hub_id'] or base['name']}, layer {config['layer']}",
        "",
        f"A conditional diffusion bridge for {base_name} ({PAPER}): it samples the residual state at layer "
        f"{config['layer']} from the tokens' embeddings, and the base model's blocks above it, final norm and LM "
        "head (not in this package) turn that state into next-token logits. Made with "
        "[dihal](https://pypi.org/project/dihal/), artifact `bridge/" + config["bridge"] + "`.",
        "",
        "## Base model",
        "",
        f"- {described}" + (f" at revision `{base['revision']}`" if base.get("revision") else ""),
        f"- sha256 of its weights and tokenizer: `{base['sha256']}` (checked at load)",
        f"- {base.get('architecture')}, {base.get('num_blocks')} blocks, width {base.get('width')}",
        "",
        "## Training",
        "",
        f"- {protocol}",
        f"- data: {config['extract']['dataset']}, {config['extract']['seq_len']} tokens per sequence, starting "
        f"with the {config['extract']['start_token']['rule']} token",
        f"- {metrics.get('n_train_sequences', '?')} training sequences, {metrics.get('tokens_seen', '?')} tokens "
        f"seen; validation loss {_num(metrics.get('val_loss'))}",
        f"- sampling: {config['steps']} Euler steps per position, noise seed {config['seed']}",
        "",
        "## Results in the store it was exported from",
        "",
    ]
    if results.fidelity:
        lines += ["Teacher-forced fidelity (METHOD §3):", ""]
        lines += ["| source | steps | rel. error | cosine | KL | top-1 | PPL ratio |", "|---|---|---|---|---|---|---|"]
        for r in results.fidelity:
            cells = [_num(r.get(k)) for k in ("rel_recon_error", "cosine", "kl", "top1_agreement", "ppl_ratio")]
            lines.append(f"| {r['source']} | {r.get('steps', '')} | " + " | ".join(cells) + " |")
        lines.append("")
    if results.lm_eval:
        lines += ["lm-evaluation-harness:", "", "| task | metric | n | hybrid | original |", "|---|---|---|---|---|"]
        for r in results.lm_eval:
            lines.append(
                f"| {r['task']} | {r['metric']} | {r.get('n', '')} | {_num(r['hybrid'])} | {_num(r['original'])} |"
            )
        lines.append("")
    if not (results.fidelity or results.lm_eval):
        lines += ["None yet: run `dihal evaluate --bridge ID` before exporting to include them.", ""]
    load_base = "" if base["source"] in ("hub", "builtin") else ', base_model="PATH/TO/' + str(base["name"]) + '"'
    lines += [
        "## Use",
        "",
        "```python",
        "import dihal",
        f'hybrid = dihal.from_pretrained("THIS_REPO_OR_FOLDER"{load_base})',
        'print(hybrid.generate("def main(", max_new_tokens=32).texts[0])',
        "```",
        "",
        "or `dihal import THIS_REPO_OR_FOLDER` to run `dihal evaluate` / `dihal generate` on it, or "
        "`python -m dihal.lm_eval --model dihal --model_args pretrained=THIS_REPO_OR_FOLDER --tasks ...`.",
        "",
        "## Citation",
        "",
        f"{PAPER}; dihal's own citation is in its CITATION.cff.",
        "",
    ]
    return str(ModelCard("---\n" + data.to_yaml() + "\n---\n" + "\n".join(lines)))


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


# -- reading -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Package:
    """An exported bridge on disk, its files checked against config.json's sha256s."""

    path: Path
    config: dict

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def meta(self) -> dict:
        """bridge.json as the store writes it (stages/parts/bridge.py reads it)."""
        c = self.config
        return {"layer": c["layer"], "start": c["start"], "prediction": c["prediction"], "denoiser": c["denoiser"]}


def resolve(ref: str | os.PathLike, revision: str | None = None) -> Path:
    """A package's folder: a local folder, else a hub repo id (downloaded, or read from the HF cache offline)."""
    path = Path(ref).expanduser()
    if path.exists():
        return path
    text = str(ref)
    if text.count("/") != 1 or text.startswith((".", "/")):
        raise DihalError(f"'{ref}' is neither an exported bridge's folder nor a hub repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:  # the local HF cache first: no network when it is there
        return Path(snapshot_download(text, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached
        pass
    if not hub.reachable():
        raise DihalError(
            f"bridge '{ref}' is not a folder, not in the local Hugging Face cache, and the hub cannot be reached "
            "(offline or HF_HUB_OFFLINE=1); give the exported folder"
        )
    try:
        return Path(snapshot_download(text, revision=revision))
    except Exception as exc:  # noqa: BLE001 - no such repo, no access
        raise DihalError(f"cannot download bridge '{ref}' from the hub ({type(exc).__name__}); check the id") from None


def read(ref: str | os.PathLike, revision: str | None = None) -> Package:
    """The package at a folder or hub id, every listed file checked; one line for what is wrong."""
    path = resolve(ref, revision)
    if not path.is_dir():
        raise DihalError(f"{path} is not a folder; give the folder `dihal export` wrote")
    if not (path / CONFIG).is_file():
        raise DihalError(f"{path} has no {CONFIG}; it is not an exported bridge (make one with `dihal export`)")
    try:
        config = json.loads((path / CONFIG).read_text())
    except ValueError:
        raise DihalError(f"{path / CONFIG} is not JSON; export the bridge again") from None
    if not isinstance(config, dict) or config.get("model_type") != "dihal_hybrid":
        raise DihalError(f"{path / CONFIG} is not a dihal bridge's config (model_type dihal_hybrid)")
    version = config.get("dihal_format")
    if not isinstance(version, int) or version > FORMAT:
        raise DihalError(
            f"{path} is in package format {version}, newer than this dihal reads ({FORMAT}); upgrade dihal"
        )
    for name in (WEIGHTS, STATS):
        if not (path / name).is_file():
            raise DihalError(f"{path} has no {name}; the export is incomplete, export the bridge again")
    for name, digest in (config.get("files") or {}).items():
        if not (path / name).is_file() or file_sha256(path / name) != digest:
            raise DihalError(f"{path / name} does not match the sha256 in {CONFIG} (corrupt or edited); export again")
    return Package(path, config)


def check_base(package: Package, actual: str, check: bool) -> dict:
    """The base model is the one the bridge was trained on (its content hash), or check=False says to
    use it anyway; returns what to record."""
    expected = package.config["base"]["sha256"]
    if check and actual != expected:
        raise DihalError(
            f"the base model's weights and tokenizer hash to {actual}, but the bridge was trained on "
            f"{expected} ({package.config['base']['name']}); give that model, or check_base=False"
        )
    return {"expected_sha256": expected, "sha256": actual, "checked": check, "matches": actual == expected}


def check_layer(package: Package, num_blocks: int) -> None:
    layer = package.config["layer"]
    if not 1 <= layer < num_blocks:
        raise DihalError(
            f"the bridge replaces layers up to {layer}, but the base model has {num_blocks} blocks; give the "
            "model it was trained on"
        )


# -- pushing and importing ----------------------------------------------------------------------------------
def push(folder: Path, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Upload an exported folder to a hub model repo (created if need be); returns the commit's URL."""
    from huggingface_hub import HfApi

    if hub.offline():
        raise DihalError(f"--push-to-hub {repo_id}: the hub is switched off (HF_HUB_OFFLINE=1); unset it to push")
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(
        folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=f"dihal bridge {folder.name}"
    )
    return str(getattr(info, "commit_url", info))


def import_bridge(package: Package, store: ArtifactStore, model: str, progress=None) -> Artifact:
    """Bring a package into a store as the bridge artifact it was exported from, under its own id, its
    base model given by `model` (a --model spec, checked against the package's hash), so evaluate,
    generate and compare run on it. The extract it came from stays behind: its parent id is kept."""
    origin = package.config["artifact"]
    config = {k: v for k, v in origin["config"].items() if k != "cache_version"}
    version = origin["config"].get("cache_version")
    manifest = json.loads(package.file(MANIFEST).read_text())
    where, identity = locate(model)
    identity["revision"] = package.config["base"].get("revision") if identity["source"] == "hub" else None
    base = check_base(package, base_sha256(where, identity), True)
    extract_config = {**(manifest.get("extract_config") or {}), "model": model, "revision": identity["revision"]}
    model_identity = {
        **{k: v for k, v in (manifest.get("model") or {}).items() if k not in ("path",)},
        **{k: v for k, v in identity.items() if k != "revision"},
    }

    def work(art: Artifact) -> None:
        shutil.copyfile(package.file(WEIGHTS), art.file("weights_ema.safetensors"))
        shutil.copyfile(package.file(STATS), art.file("stats.safetensors"))
        art.file("bridge.json").write_text(json.dumps(package.meta, indent=2))
        for name in LOG_FILES:
            if package.file(name).is_file():
                shutil.copyfile(package.file(name), art.file(name))
        art.manifest["metrics"] = manifest.get("metrics", {})

    extra = {
        "model": model_identity,
        "extract_config": extract_config,
        "imported": {"from": public(str(package.path)), "base_model": base, "exported_manifest": manifest},
    }
    job = Job("bridge", version, config, origin["parents"], work, device="cpu", extra=extra)
    if job.id != origin["id"]:
        raise DihalError(f"{package.path}'s config does not hash to its id {origin['id']} (edited); export again")
    return store.run_stage(job, progress=progress)


def default_base(package: Package) -> str:
    """The --model spec of a package's base model where it names one (a builtin or a hub id)."""
    base = package.config["base"]
    if base["source"] == "hub":
        return base["hub_id"]
    if base["source"] == "builtin":
        return base["name"]
    raise DihalError(
        f"the bridge's base model is the {base['source']} model '{base['name']}'; give its path (--base-model, "
        "or base_model= in Python)"
    )

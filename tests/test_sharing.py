"""A bridge that leaves its store (stages/export.py, docs/sharing.md): exported alone with its base model's
content hash, loaded with no store in a fresh process from another path or a hub snapshot, refused on
another base model, pushed to a (stubbed) hub, imported under its own id, resolved by transformers'
Auto classes, and scored by the `lm_eval` command itself."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

import dihal
from dihal.artifacts.errors import DihalError
from tests.conftest import ROOT, build_tiny, invoke
from tests.test_api import LM_EVAL, TASKS, api_stores, store_of  # noqa: F401  (fixtures)

EXPECTED_FILES = {
    "README.md",
    "bridge.safetensors",
    "config.json",
    "dihal_manifest.json",
    "loss_curve.png",
    "metrics.jsonl",
    "stats.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
IDS = [[1, 50, 60, 70, 80, 90, 100, 110], [1, 7, 8, 9, 10, 11, 12, 13]]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _folder_hash(folder) -> str:
    """The content hash docs/sharing.md defines, computed here from the files: sha256 over
    'name NUL sha256(file) LF' for the weights and then the vocabulary files."""
    parts = [p for p in sorted(folder.glob("*.safetensors"))] + [folder / "tokenizer.json"]
    return hashlib.sha256("".join(f"{p.name}\0{_sha(p)}\n" for p in parts).encode()).hexdigest()


@pytest.fixture()
def exported(store_of, tmp_path):  # noqa: F811
    store = store_of()
    out = tmp_path / "pkg"
    res = invoke("export", str(out))
    assert res.exit_code == 0, res.output
    return store, out


@pytest.fixture()
def moved(tiny_dirs, tmp_path):
    """The base model at another path, as a colleague keeps it."""
    return shutil.copytree(tiny_dirs["llama"], tmp_path / "elsewhere" / "my-llama")


def test_an_exported_bridge_holds_the_bridge_alone_and_names_its_base_by_content(exported, tiny_dirs):
    store, out = exported
    art = store.load("latest", "bridge").artifact
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES
    assert sum(p.stat().st_size for p in out.iterdir()) < 1 << 20  # a tiny bridge: well under a few MB
    weights = load_file(out / "bridge.safetensors")
    backbone = set(build_tiny("llama")[0].state_dict())
    assert weights and not set(weights) & backbone and all(not k.startswith(("model.", "lm_head")) for k in weights)
    ema = load_file(art.path / "weights_ema.safetensors")
    assert set(weights) == set(ema) and all(torch.equal(weights[k], ema[k]) for k in ema)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "dihal_hybrid" and config["dihal_format"] == 1
    assert (
        config["bridge"] == art.id and config["layer"] == 2 and config["artifact"]["parents"] == art.manifest["parents"]
    )
    assert config["base"]["sha256"] == _folder_hash(tiny_dirs["llama"])  # computed here from the files
    assert config["base"]["source"] == "local" and config["base"]["name"] == tiny_dirs["llama"].name
    assert config["extract"]["seq_len"] == 64 and config["extract"]["start_token"] == {"id": 1, "rule": "bos"}
    assert config["files"] == {p.name: _sha(p) for p in out.iterdir() if p.name != "config.json"}
    text = (out / "config.json").read_text() + (out / "dihal_manifest.json").read_text()
    assert str(tiny_dirs["llama"]) not in text and str(store.root) not in text  # no absolute path leaves
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "dihal" and "dihal" in front["tags"]
    assert config["base"]["sha256"] in card and "dihal.from_pretrained" in card and "sweep-tiny" in card


def test_save_pretrained_writes_what_dihal_export_writes(exported, tmp_path):
    store, out = exported
    hybrid = dihal.load_hybrid("latest", root=store.root)
    hybrid.save_pretrained(tmp_path / "again")
    assert {p.name: _sha(p) for p in out.iterdir()} == {p.name: _sha(p) for p in (tmp_path / "again").iterdir()}
    with pytest.raises(DihalError, match="exists and is not empty"):
        hybrid.save_pretrained(out)


LOAD = """
import json, os, sys, torch
import dihal
from transformers import AutoConfig, AutoModelForCausalLM
pkg, base, out = sys.argv[1:4]
ids = torch.tensor({ids})
hybrid = dihal.from_pretrained(pkg, base_model=base)
auto = AutoModelForCausalLM.from_pretrained(pkg, base_model=base)
torch.save({{"logits": hybrid(input_ids=ids).logits, "auto": auto(input_ids=ids).logits}}, out)
print(json.dumps({{"auto_config": type(AutoConfig.from_pretrained(pkg)).__name__, "auto": type(auto).__name__,
                  "check": hybrid.config.base_check, "offline": os.environ["HF_HUB_OFFLINE"]}}))
"""


def _load_elsewhere(pkg, base, tmp_path, env=None):
    out = tmp_path / "logits.pt"
    code = LOAD.format(ids=IDS)
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(pkg), str(base), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(out)


@pytest.mark.slow
def test_a_moved_base_model_loads_the_export_in_a_fresh_process_with_load_hybrids_logits(exported, moved, tmp_path):
    store, out = exported
    pkg = shutil.move(str(out), tmp_path / "shared" / "bridge")  # the package moves too
    seen, logits = _load_elsewhere(pkg, moved, tmp_path)
    assert seen == {
        "auto_config": "HybridConfig",
        "auto": "HybridForCausalLM",
        "check": {
            "expected_sha256": seen["check"]["sha256"],
            "sha256": seen["check"]["sha256"],
            "checked": True,
            "matches": True,
        },
        "offline": "1",
    }
    reference = dihal.load_hybrid("latest", root=store.root)(input_ids=torch.tensor(IDS)).logits
    torch.testing.assert_close(logits["logits"], reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits["auto"], reference, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_hub_id_loads_from_a_snapshot_in_the_hf_cache_offline(exported, moved, tmp_path):
    """The hub cache's layout: models--OWNER--NAME/snapshots/COMMIT/<files>, refs/main naming the commit."""
    store, out = exported
    cache = tmp_path / "hf-cache"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(out, cache / "models--someone--tiny-bridge" / "snapshots" / commit)
    (cache / "models--someone--tiny-bridge" / "refs").mkdir()
    (cache / "models--someone--tiny-bridge" / "refs" / "main").write_text(commit)
    seen, logits = _load_elsewhere("someone/tiny-bridge", moved, tmp_path, {"HF_HUB_CACHE": str(cache)})
    assert seen["auto"] == "HybridForCausalLM" and seen["check"]["matches"]
    reference = dihal.load_hybrid("latest", root=store.root)(input_ids=torch.tensor(IDS)).logits
    torch.testing.assert_close(logits["logits"], reference, atol=1e-5, rtol=0)


def test_another_base_model_is_refused_naming_both_hashes_unless_check_base_is_off(exported, tiny_dirs):
    _, out = exported
    wanted = json.loads((out / "config.json").read_text())["base"]["sha256"]
    other = _folder_hash(tiny_dirs["qwen3"])
    with pytest.raises(DihalError) as err:
        dihal.from_pretrained(out, base_model=tiny_dirs["qwen3"])
    assert str(err.value).count("\n") == 0 and wanted in str(err.value) and other in str(err.value)
    hybrid = dihal.from_pretrained(out, base_model=tiny_dirs["qwen3"], check_base=False)
    assert hybrid.config.base_check == {
        "expected_sha256": wanted,
        "sha256": "unchecked",
        "checked": False,
        "matches": False,
    }
    with pytest.raises(DihalError, match="give its path"):
        dihal.from_pretrained(out)  # a local base model is named, never located by an absolute path
    model, tokenizer = build_tiny("llama")
    with pytest.raises(DihalError, match="names no files to hash"):
        dihal.from_pretrained(out, base_model=(model, tokenizer))
    model.name_or_path = str(tiny_dirs["llama"])
    assert dihal.from_pretrained(out, base_model=(model, tokenizer)).config.base_check["matches"]


def test_push_to_hub_uploads_the_package_to_the_named_repo(exported, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, repo_type=None, private=False, exist_ok=False):
            calls.append(("create", repo_id, repo_type, private, exist_ok))

        def upload_folder(self, folder_path, repo_id, repo_type=None, commit_message=None):
            files = sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir())
            calls.append(("upload", repo_id, repo_type, files))
            return type("Info", (), {"commit_url": f"https://hub/{repo_id}/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    store, _ = exported
    res = invoke("export", str(tmp_path / "pushed"), "--push-to-hub", "someone/tiny-bridge", "--private")
    assert res.exit_code == 0, res.output
    assert calls == [
        ("token", None),
        ("create", "someone/tiny-bridge", "model", True, True),
        ("upload", "someone/tiny-bridge", "model", sorted(EXPECTED_FILES)),
    ]
    assert "pushed: someone/tiny-bridge" in res.output
    calls.clear()
    dihal.load_hybrid("latest", root=store.root).push_to_hub("someone/other")
    assert calls[1] == ("create", "someone/other", "model", False, True) and calls[2][3] == sorted(EXPECTED_FILES)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = invoke("export", str(tmp_path / "p3"), "--push-to-hub", "someone/x")
    assert offline.exit_code == 2 and "error: --push-to-hub someone/x: the hub is switched off" in offline.output


def test_import_brings_the_package_into_a_store_under_its_own_id(exported, moved, tmp_path, monkeypatch):
    store, out = exported
    original = store.load("latest", "bridge")
    other = tmp_path / "their-runs"
    monkeypatch.setenv("DIHAL_ROOT", str(other))
    res = invoke("import", str(out), "--base-model", str(moved))
    assert res.exit_code == 0, res.output
    art = dihal.open_store(other).load("latest", "bridge")
    assert art.id == original.id and art.config == original.config and art.artifact.verify() == []
    assert art.manifest["imported"]["base_model"]["matches"] and art.manifest["extract_config"]["model"] == str(moved)
    for name in ("weights_ema.safetensors", "stats.safetensors"):
        assert _sha(art.path / name) == _sha(original.path / name)
    again = invoke("import", str(out), "--base-model", str(moved))
    assert again.exit_code == 0 and "cache hit: bridge" in again.output
    gen = invoke("generate", "--bridge", art.id, "--max-new-tokens", "4", "--device", "cpu")
    assert gen.exit_code == 0, gen.output
    fid = invoke("evaluate", "--bridge", art.id, "--device", "cpu")
    assert fid.exit_code == 2 and "was imported without it; give --dataset SPEC" in fid.output
    wrong = invoke("import", str(out), "--base-model", str(build_dir(tmp_path, "qwen3")))
    assert wrong.exit_code == 2 and "but the bridge was trained on" in wrong.output
    config = json.loads((out / "config.json").read_text())
    config["artifact"]["config"]["steps"] = 7  # an edited recipe no longer hashes to the id it claims
    (out / "config.json").write_text(json.dumps(config))
    edited = invoke("import", str(out), "--base-model", str(moved))
    assert edited.exit_code == 2 and "does not hash to its id" in edited.output


def build_dir(tmp_path, kind: str, layers: int = 4):
    model, tok = build_tiny(kind, layers)
    path = tmp_path / f"{kind}-{layers}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_broken_or_foreign_package_is_one_line(exported, moved, tmp_path, monkeypatch):
    _, out = exported

    def error(ref, *extra):
        res = invoke("import", str(ref), "--base-model", str(moved), *extra)
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
        return res.output

    no_config = shutil.copytree(out, tmp_path / "a")
    (no_config / "config.json").unlink()
    assert "has no config.json; it is not an exported bridge" in error(no_config)
    no_weights = shutil.copytree(out, tmp_path / "b")
    (no_weights / "bridge.safetensors").unlink()
    assert "has no bridge.safetensors; the export is incomplete" in error(no_weights)
    newer = shutil.copytree(out, tmp_path / "c")
    config = json.loads((newer / "config.json").read_text())
    (newer / "config.json").write_text(json.dumps({**config, "dihal_format": 99}))
    assert "package format 99, newer than this dihal reads (1); upgrade dihal" in error(newer)
    flipped = shutil.copytree(out, tmp_path / "d")
    data = bytearray((flipped / "stats.safetensors").read_bytes())
    data[-1] ^= 1
    (flipped / "stats.safetensors").write_bytes(bytes(data))
    assert "stats.safetensors does not match the sha256 in config.json" in error(flipped)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert "not in the local Hugging Face cache, and the hub cannot be reached" in error("someone/absent-bridge")
    shallow = build_dir(tmp_path, "llama", layers=2)
    with pytest.raises(DihalError, match="replaces layers up to 2, but the base model has 2 blocks"):
        dihal.from_pretrained(out, base_model=shallow, check_base=False)


def test_citation_cff_is_valid_cff_and_cites_the_paper():
    import jsonschema

    schema = json.loads((ROOT / "tests" / "data" / "cff-1.2.0.schema.json").read_text())
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    jsonschema.Draft7Validator(schema).validate(citation)
    assert citation["preferred-citation"]["url"] == "https://arxiv.org/abs/2605.14368"
    project = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{citation["version"]}"' in project and citation["license"] in project


# -- the harness's own command line ----------------------------------------------------------------------------
@pytest.mark.slow
def test_the_lm_eval_command_scores_an_export_as_simple_evaluate_does(exported, moved, tmp_path):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    _, out = exported
    results = tmp_path / "results"
    command = [sys.executable, "-m", "dihal.lm_eval", "--model", "dihal"]
    command += ["--model_args", f"pretrained={out},base_model={moved}", "--tasks", "dihal_pydoc_mc,dihal_pydoc_ppl"]
    command += ["--include_path", str(TASKS), "--output_path", str(results), "--log_samples", "--device", "cpu"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(next(results.rglob("results_*.json")).read_text())["results"]
    assert list(results.rglob("samples_dihal_pydoc_mc_*.jsonl"))
    hybrid = dihal.from_pretrained(out, base_model=moved)
    lm = HFLM(pretrained=hybrid, tokenizer=hybrid.tokenizer, backend="causal", max_length=hybrid.positions)
    here = lm_eval.simple_evaluate(
        model=lm,
        tasks=["dihal_pydoc_mc", "dihal_pydoc_ppl"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
    )
    for task, metric in (("dihal_pydoc_mc", "acc,none"), ("dihal_pydoc_ppl", "word_perplexity,none")):
        assert written[task][metric] == pytest.approx(here["results"][task][metric], rel=1e-9)


@pytest.mark.slow
def test_evaluate_lm_eval_keeps_the_harness_whole_result_and_its_samples(store_of, root):  # noqa: F811
    store = store_of()
    res = invoke(
        "evaluate",
        "--bridge",
        "latest",
        *LM_EVAL,
        "--lm-eval-limit",
        "3",
        "--lm-eval-fewshot",
        "1",
        "--lm-eval-log-samples",
    )
    assert res.exit_code == 0, res.output
    art = store.load("latest", "evaluate")
    full = json.loads((art.path / "lm_eval.json").read_text())
    for name in ("hybrid", "original"):
        assert {"results", "configs", "versions", "n-shot", "n-samples", "higher_is_better"} <= set(full[name])
        assert (
            full[name]["n-shot"]["dihal_pydoc_mc"] == 1 and full[name]["configs"]["dihal_pydoc_mc"]["num_fewshot"] == 1
        )
        rows = (art.path / "samples" / name / "dihal_pydoc_mc.jsonl").read_text().splitlines()
        assert len(rows) == 3 and {"doc", "resps", "acc"} <= set(json.loads(rows[0]))
    assert art.config["num_fewshot"] == 1 and art.config["log_samples"] is True


@pytest.mark.slow
def test_the_harness_models_take_a_store_id_and_an_exported_folder_through_hf(exported, moved):
    """--model dihal with bridge=ID,root= (a store's bridge), and the harness's own `hf` model reading an
    exported folder through AutoModelForCausalLM (which `import dihal` taught the hybrid): both score the MC
    task as the in-process hybrid does."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    import dihal.lm_eval  # noqa: F401  (registers --model dihal)

    store, out = exported
    art = store.load("latest", "bridge")
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    accuracy = {}
    for name, args in (
        ("dihal", f"bridge={art.id},root={store.root}"),
        ("hf", f"pretrained={out},base_model={moved},dtype=float32"),
    ):
        lm = get_model(name).create_from_arg_string(args, {"batch_size": 1, "device": "cpu"})
        assert type(lm.model).__name__ == "HybridForCausalLM"
        result = lm_eval.simple_evaluate(model=lm, tasks=["dihal_pydoc_mc"], task_manager=manager, limit=6)
        accuracy[name] = result["results"]["dihal_pydoc_mc"]["acc,none"]
    assert accuracy["dihal"] == accuracy["hf"]


def test_a_store_id_that_reads_as_a_number_reaches_the_harness_model_as_text(monkeypatch):
    """lm-eval reads every model_args value that looks like a number as one: the store id 8e7362519074 became
    float('inf') (`no bridge artifact 'inf'`, seen in CI when a bridge's id took that form) and 012345678901 lost
    its leading 0. --model dihal keeps ids and paths as written; other values still parse as the harness's do."""
    from dihal.lm_eval import DihalLM

    seen = {}
    monkeypatch.setattr(DihalLM, "__init__", lambda self, **kw: seen.update(kw))
    DihalLM.create_from_arg_string("bridge=8e7362519074,root=runs/1e5,steps=8", {"batch_size": 1, "device": None})
    assert seen == {"bridge": "8e7362519074", "root": "runs/1e5", "steps": 8, "batch_size": 1}
    DihalLM.create_from_arg_string("bridge=012345678901")
    assert seen["bridge"] == "012345678901"

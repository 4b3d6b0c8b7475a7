"""The house: a --help that loads no numeric stack, one recipe validated in one place, every bad
value one `error:` line, CLI defaults equal to the configs', ids that do not move, one namespace."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
import typing
import zipfile
from dataclasses import MISSING, asdict
from pathlib import Path

import pytest

from dihal.artifacts.store import artifact_id
from dihal.stages import configs as C
from tests.conftest import ROOT, invoke

HEAVY = ("torch", "transformers", "scipy", "pandas", "zarr", "datasets", "numpy")


def _app():
    from dihal.cli.main import app

    return app


def _commands() -> dict:
    """{command path: click command} of the whole app, the `runs` group's included."""
    import typer.main

    group = typer.main.get_command(_app())
    out = {}
    for name, cmd in group.commands.items():
        subs = getattr(cmd, "commands", None)
        for sub_name, sub in (subs or {name: cmd}).items():
            out[f"{name} {sub_name}" if subs else name] = sub
    return out


def test_help_loads_no_numeric_stack():
    """`dihal --help` and every `dihal CMD --help`, in a fresh interpreter: none of the heavy modules."""
    code = f"""
import json, sys
from typer.testing import CliRunner
from dihal.cli.main import app
runner = CliRunner()
paths = [[]] + [[c] for c in {sorted({p.split()[0] for p in _commands()})!r}] + [["runs", "list"]]
codes = [runner.invoke(app, [*p, "--help"]).exit_code for p in paths]
print(json.dumps({{"codes": codes, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["codes"]) == {0}
    assert result["heavy"] == []


# -- one recipe --------------------------------------------------------------------------------------
TRAINING = {  # every command that trains, with the arguments it needs to get as far as its recipe
    "train-bridge": ["--layer", "1"],
    "train-prior": [],
    "train-decoder": [],
    "sweep": ["--layers", "1"],
    "compare": [],
    "confirm": [],
}
BATCH_FLAG = {"compare": "--train-batch", "confirm": "--train-batch"}
BAD_RECIPE = [("batch", "0"), ("--lr", "0"), ("--lr", "-0.001"), ("--ema", "1"), ("--ema", "-0.5"), ("--warmup", "-1")]


def one_error_line(res) -> bool:
    lines = res.output.strip().splitlines()
    return res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output


@pytest.mark.parametrize("command", sorted(TRAINING))
@pytest.mark.parametrize("flag,value", BAD_RECIPE)
def test_every_training_command_refuses_a_bad_recipe(command, flag, value, tiny_dirs):
    flag = BATCH_FLAG.get(command, "--batch-size") if flag == "batch" else flag
    model = ["--model", str(tiny_dirs["llama"])] if command in MODEL_COMMANDS else []
    res = invoke(command, *TRAINING[command], *model, flag, value, "--dry-run")
    assert one_error_line(res), res.output
    assert flag.replace("train-batch", "batch-size") in res.output, res.output


def test_recipe_checks_live_in_one_place():
    """The recipe's fields are validated by Recipe.check alone: no part config re-checks them."""
    recipe_fields = {"lr", "ema", "warmup", "batch_size", "schedule", "grad_clip", "weight_decay"}
    for cls in (C.BridgeConfig, C.PriorConfig, C.DecoderTrainConfig, C.PartRecipe):
        source = inspect.getsource(cls.check)
        assert not any(f"self.{name}" in source for name in recipe_fields), cls.__name__


# -- every numeric option, every odd value --------------------------------------------------------------
BASE_ARGS = {  # what each command needs to reach its configs under --dry-run
    "train-bridge": ["--layer", "1"],
    "sweep": ["--layers", "1"],
    "evaluate": ["--bridge", "x"],
    "export": ["pkg-out"],
}
MODEL_COMMANDS = {"extract", "train-bridge", "sweep", "compare"}
# numeric options where 0 is a valid value (and so the CLI must accept it), from docs/method.md and the
# configs' own meaning: a seed, warm-up, EMA 0, no condition noise, greedy decoding, top-k off, no pool,
# no bootstrap draws, a prior over layer 0, a validation fraction of 0, no own text in a bridge's data,
# gamma 0 (the guided readouts read as independent), bridge noise 0 (the flow's mean path)
ZERO_OK = {
    "guidance",
    "bridge-noise",
    "seed",
    "own-seed",
    "own-text",
    "warmup",
    "ema",
    "condition-noise",
    "temperature",
    "top-k",
    "score-pool",
    "bootstrap",
    "val-fraction",
    "shuffle-buffer",
    "token-ce",
    "prior-token-ce",
}
ZERO_OK_IN = {("train-prior", "layer")}


def _numeric_options(cmd) -> list[str]:
    """The flags of a command's int and float options (Optional ones included), from their annotations."""
    numeric = []
    for p in cmd.params:
        annotation = p.type_descriptor.annotation
        if p.opts[0].startswith("--") and {int, float} & set(typing.get_args(annotation) or (annotation,)):
            numeric.append(p.opts[0])
    return numeric


def _cases():
    for path, cmd in _commands().items():
        if path.startswith("runs"):
            continue
        for flag in _numeric_options(cmd):
            for value in ("nan", "inf", "-inf", "-1", "0"):
                yield path, flag, value


@pytest.mark.parametrize("path,flag,value", list(_cases()))
def test_every_numeric_option_accepts_only_valid_values(path, flag, value, tiny_dirs):
    args = [*path.split(), *BASE_ARGS.get(path, [])]
    if path in MODEL_COMMANDS:
        args += ["--model", str(tiny_dirs["llama"])]
    if flag == "--layer" and path == "train-bridge":
        args = [path]
    res = invoke(*args, flag, value, "--dry-run")
    name = flag[2:]
    valid = value == "0" and (name in ZERO_OK or (path, name) in ZERO_OK_IN)
    if valid:
        assert res.exit_code == 0, res.output
    else:
        assert one_error_line(res), f"dihal {' '.join(args)} {flag} {value}:\n{res.output}"


def test_global_log_every_refuses_non_finite():
    for value in ("nan", "inf", "-inf", "-1"):
        assert one_error_line(invoke("--log-every", value, "runs", "list")), value


def test_a_value_that_is_not_a_number_is_one_line():
    res = invoke("score", "--tokens", "many", "--dry-run")
    assert one_error_line(res) and "--tokens" in res.output and "score --help" in res.output


# -- defaults written once ----------------------------------------------------------------------------------
CONFIG_OF = {  # the config whose fields a command's options set
    "extract": (C.ExtractConfig, C.DataConfig),
    "score": (C.ScoreConfig,),
    "train-bridge": (C.BridgeConfig, C.DataConfig, C.ExtractConfig),
    "train-prior": (C.PriorConfig,),
    "train-decoder": (C.DecoderTrainConfig,),
    "evaluate": (C.FidelityConfig, C.SamplesConfig),
    "generate": (C.GenerateConfig,),
    "sweep": (C.SweepConfig, C.ScoreConfig, C.DataConfig, C.ExtractConfig),
    "compare": (C.CompareConfig, C.ScoreConfig, C.DataConfig, C.ExtractConfig),
    "confirm": (C.ConfirmConfig,),
}
RESOLVED = {"device", "dtype", "own_samples"}  # "auto" on the command line, resolved by the run
RESOLVED_IN = {("generate", "batch_size")}  # the same, for one command's option ("auto": 8 on the CPU, the config's)


def _config_default(classes, name: str):
    for cls in classes:
        field = cls.__dataclass_fields__.get(name)
        if field is None:
            continue
        if name == "protocol":
            return cls.PROTOCOL if hasattr(cls, "PROTOCOL") else field.default
        if field.default is MISSING:
            return MISSING
        value = field.default
        if name == "condition_noise":  # the option reads kind:value (prior:T or sigma:S)
            return f"{cls.__dataclass_fields__['condition_from'].default}:{value:g}"
        return ",".join(map(str, value)) if isinstance(value, tuple) else value
    return MISSING


def test_no_cli_default_differs_from_its_config():
    checked = 0
    for path, classes in CONFIG_OF.items():
        cmd = _commands()[path]
        for p in cmd.params:
            if p.name in RESOLVED or (path, p.name) in RESOLVED_IN:
                continue
            if (p.rich_help_panel or "").startswith("Recipe"):  # None: the protocol's value
                assert p.default is None, f"dihal {path} {p.opts[0]} must default to the protocol's value"
                continue
            expected = _config_default(classes, p.name)
            if expected is MISSING:
                continue
            if p.multiple:  # a repeatable option (--dataset): its default is the config's one value
                expected = [expected]
            if p.name == "mix":  # None on the command line: no shares, the config's ()
                expected = None if expected == "" else expected
            assert p.default == expected, f"dihal {path} {p.opts[0]}: {p.default!r} != config's {expected!r}"
            checked += 1
    assert checked > 60


# -- ids and packaging --------------------------------------------------------------------------------------
PARENT = {"extract": "0123456789ab"}


def schema2_id(stage, config, parents):
    """The id a config had under schema 2, before every key held its stage's CACHE_VERSION (issue 45):
    the resolved configs below are pinned as they were hashed then."""
    return artifact_id(stage, config, parents, schema=2)


def test_artifact_ids_do_not_move():
    """Resolved configs as the landed main hashed them (before the configs moved into stages/configs.py),
    and the ids they have now: schema 3 hashes each stage's CACHE_VERSION into every key (docs/history.md)."""
    from dihal.artifacts.store import Job
    from dihal.stages import extract as ex
    from dihal.stages import train_bridge as br

    artifact_id_for = lambda cfg: schema2_id("extract", ex.resolved_config(cfg), ex.source_parents(cfg))

    data = C.DataConfig(dataset="/data/corpus.txt", seq_len=32)
    float32 = C.ExtractConfig(model="smollm2-135m", layers="0,3", store_dtype="float32", data=data)
    assert artifact_id_for(float32) == "2126464a0a3a"  # the same bytes as before
    # auto and float16 extracts now keep position 0 apart (pos0/<l>): other bytes, so another id
    # than the landed main's 41fc8ad98336 (README, Artifacts)
    assert artifact_id_for(C.ExtractConfig(model="smollm2-135m", layers="0,3", data=data)) == "4264ada3be75"
    bridge = C.BridgeConfig.from_protocol("cpu-small", layer=3, positions="learned")
    assert schema2_id("bridge", bridge.hashed(), PARENT) == "bd3dce03b649"  # condition_from at its default
    # a learned-position bridge keeps its id; the default, rotary since issue 47, hashes its positions
    assert schema2_id("bridge", C.BridgeConfig.from_protocol("cpu-small", layer=3).hashed(), PARENT) != "bd3dce03b649"
    bridge2 = C.BridgeConfig.from_protocol(
        "sweep-tiny",
        layer=2,
        steps=40,
        width=64,
        condition_noise=0.5,
        precision="bfloat16",
        device="cuda",
        positions="learned",
    )
    gpu = bridge2.hashed()  # a GPU bridge steps with fused AdamW (issue 64), which it hashes: a new id, the rest
    assert gpu.pop("optimizer") == "adamw, fused"  # as the landed main hashed it
    assert gpu.pop("validation_noise") == "device"  # GPU validation noise drawn on the device (issue 64)
    assert schema2_id("bridge", gpu, PARENT) == "d1ba952ccba3"
    assert (
        schema2_id(
            "bridge",
            C.BridgeConfig.from_protocol("cpu-small", layer=3, condition_from="prior", condition_noise=0.5).hashed(),
            PARENT,
        )
        != "bd3dce03b649"
    )
    prior = C.PriorConfig.from_protocol("compare-cpu", layer=0, self_condition=True)
    assert schema2_id("prior", prior.hashed(), PARENT) == "b959c4f12aa6"  # latent False is not hashed
    latent = C.PriorConfig.from_protocol("compare-cpu", latent=True)
    assert schema2_id("prior", latent.hashed(), PARENT) != schema2_id("prior", prior.hashed(), PARENT)
    # the decoder's network changed (section 5 rev 2: the frozen table), so its config gained a revision
    decoder = C.DecoderTrainConfig.from_protocol("compare-cpu")
    assert schema2_id("decoder", decoder.hashed(), PARENT) == "a8a443db7c36"  # the landed main's
    from dihal.stages import train_decoder as dec

    assert schema2_id("decoder", {**decoder.hashed(), "revision": 2}, PARENT) != "a8a443db7c36"
    assert dec.CACHE_VERSION == 2  # the revision became the decoder's CACHE_VERSION
    # an AR generation hashes the temperature it uses: at the defaults, the landed main's ids
    # (computed with its configs.py: fc16c39bd5d2 and a8e2c81d9800) at --bridge-noise 1, the scale they sampled
    # at; the default mean path (issue 66) is another generation, with its own id; a parallel one moved (README)
    on_bridge = {"bridge": "0123456789ab"}
    old = C.GenerateConfig(num_samples=16, bridge_noise=1.0)
    assert schema2_id("generate", old.hashed(), on_bridge) == "fc16c39bd5d2"
    assert schema2_id("generate", C.GenerateConfig(num_samples=16).hashed(), on_bridge) == "e82bd8180c43"
    greedy = C.GenerateConfig(num_samples=16, temperature=0.0, top_p=0.9, bridge_noise=1.0)
    assert schema2_id("generate", greedy.hashed(), on_bridge) == "a8e2c81d9800"
    gen = C.GenerateConfig(mode="parallel", recovery="hidden", num_samples=16)
    assert schema2_id("generate", gen.hashed(), {"prior": "0123456789ab"}) != "ec66f62b7c09"
    from dihal.stages import score as sc

    later = ("r2_penalty", "select", "proxies")  # fields added since
    score = {k: v for k, v in asdict(C.ScoreConfig(tokens=512, bootstrap=2)).items() if k not in later}
    score |= {"candidates": [1, 2, 3], "device": None}
    assert schema2_id("score", score, PARENT) == "a0aa95eb4ce8"  # the config as the landed main hashed it
    # a score now also hashes the registered proxies (r2_token, r2_context and their penalties are
    # columns) and the penalty grid GCV chooses from: 4cbcff973dcf with the fixed penalty (README). GCV,
    # at the geometry's positions, is --r2-penalty gcv now, and a score of it keeps that id; the default
    # 5-fold rule, at positions of its own, hashes in (docs/history.md); so would --select r2_token
    gcv = C.ScoreConfig(tokens=512, bootstrap=2, r2_penalty="gcv")
    assert schema2_id("score", sc.config_dict(gcv, [1, 2, 3]), PARENT) == "efbe8a0948fd"
    kfold = schema2_id("score", sc.config_dict(C.ScoreConfig(tokens=512, bootstrap=2), [1, 2, 3]), PARENT)
    assert kfold not in ("efbe8a0948fd", schema2_id("score", sc.config_dict(gcv, [1, 2]), PARENT))
    picked = sc.config_dict(C.ScoreConfig(tokens=512, bootstrap=2, select="r2_token"), [1, 2, 3])
    assert schema2_id("score", picked, PARENT) != kfold
    sweep = C.SweepConfig(layers=(1, 2), overrides=(("steps", 20), ("width", 32)))
    assert schema2_id("sweep", asdict(sweep), PARENT) == "6204bf89a0bb"
    # section 5 revision 2 gave the comparison its grid, controls and budgets: a new id (README)
    assert schema2_id("compare", asdict(C.CompareConfig(overrides=(("steps", 20),))), PARENT) != "59141e67990c"

    # schema 3: the same configs under their stages' CACHE_VERSION (every id moved once, docs/history.md)
    # extract's version 2 (documents joined by the pretraining end-of-document token) moved it from 81d08198107b
    assert ex.artifact_id_for(float32) == "f91c89e46bcd"
    # the bridge's version 2 (issue 64: h_0 from the token ids through the backbone's table) moved it from
    # b027ee570f95, its id under version 1
    assert Job("bridge", 1, bridge.hashed(), PARENT).id == "b027ee570f95"
    assert br.CACHE_VERSION == 2 and Job("bridge", br.CACHE_VERSION, bridge.hashed(), PARENT).id == "235ce1b93cd1"


def test_recipe_overrides_keep_their_order_on_the_command_line(tiny_dirs):
    """A sweep's overrides are hashed in order; the CLI hands them over in the order ids were made with."""
    res = invoke(
        "sweep",
        "--layers",
        "1",
        "--batch-size",
        "8",
        "--depth",
        "2",
        "--width",
        "32",
        "--train-steps",
        "20",
        "--model",
        str(tiny_dirs["llama"]),
        "--dry-run",
    )
    assert res.exit_code == 0, res.output
    assert "overrides=(('steps', 20), ('width', 32), ('depth', 2), ('batch_size', 8))" in res.output


def test_sweep_skip_init_is_an_override_only_when_it_is_not_the_default(tiny_dirs):
    """--skip-init zero reaches every bridge of the sweep as an override (issue 37's tautology check);
    the default adds nothing, so a ridge sweep keeps its id."""
    base = ["sweep", "--layers", "1", "--train-steps", "20", "--model", str(tiny_dirs["llama"]), "--dry-run"]
    zero = invoke(*base, "--skip-init", "zero")
    assert zero.exit_code == 0, zero.output
    assert "overrides=(('steps', 20), ('skip_init', 'zero'))" in zero.output
    ridge = invoke(*base, "--skip-init", "ridge")
    assert "overrides=(('steps', 20),)" in ridge.output
    bad = invoke(*base, "--skip-init", "random")
    assert bad.exit_code == 2 and "unknown --skip-init 'random'" in bad.output


def test_the_wheel_installs_one_top_level_name_and_every_module(tmp_path):
    """Built from a copy of the tracked files, so no build/lib/dihal/ copy of the source is left in the
    repository for `grep -r` to find; every source module is in the wheel (a subpackage missing from
    pyproject's list would not be)."""
    copy = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*command, str(copy)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("dihal-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"dihal"} and {"dihal/__init__.py", "dihal/api.py"} <= set(names)
    sources = {_installed(p) for p in _source_files()}
    assert sources <= set(names), sorted(sources - set(names))


# folder -> dihal.<name> ("" for dihal itself)
PACKAGES = {"dihal_cli/python": "", "dihal_cli": "cli", "stages": "stages", "artifacts": "artifacts"}


def _installed(path: Path) -> str:
    """Where a source file lands in the wheel: dihal_cli/python/ is `dihal` itself, dihal_cli/ dihal.cli."""
    folder = next(f for f in PACKAGES if path.as_posix().startswith(f + "/"))
    return "/".join(part for part in ("dihal", PACKAGES[folder], path.as_posix()[len(folder) + 1 :]) if part)


def _source_files() -> list[Path]:
    return sorted({p.relative_to(ROOT) for folder in PACKAGES for p in (ROOT / folder).rglob("*.py")})


def _dihal_imports(path: Path) -> set[str]:
    """Every dihal.* module a file imports, at the top or inside a function."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dihal.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dihal."):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # a submodule, or a name in the module
    return found


def test_every_dihal_import_resolves_statically_as_an_editor_sees_it():
    """What pyright does: find dihal/<path>.py or dihal/<path>/ on sys.path's folders, with no import hook
    (the default editable install's hook is invisible to it; scripts/setup.sh installs strict, a tree of
    links under build/). A `from dihal.x import name` may name a module or a name in one."""
    roots = [Path(entry) for entry in sys.path if entry and Path(entry).is_dir()]
    assert any((r / "dihal" / "cli" / "main.py").exists() for r in roots), (
        "no folder on sys.path holds dihal/: install it as scripts/setup.sh does (editable_mode=strict)"
    )

    def found(module: str) -> bool:
        rel = Path(*module.split("."))
        return any((r / rel).with_suffix(".py").is_file() or (r / rel / "__init__.py").is_file() for r in roots)

    unresolved = set()
    for path in _source_files():
        for module in _dihal_imports(ROOT / path):
            parent = module.rsplit(".", 1)[0]
            if not found(module) and not found(parent):
                unresolved.add(f"{path}: {module}")
    assert not unresolved, sorted(unresolved)


def test_import_contracts_hold():
    """pyproject's import-linter contracts: cli -> stages -> artifacts, and no circle among the stage
    modules (imports inside functions counted)."""
    script = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    proc = subprocess.run([script], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "Contracts: 2 kept, 0 broken." in proc.stdout and "cli and api -> stages -> artifacts" in proc.stdout


# -- default paths -------------------------------------------------------------------------------------------
REQUIRED = {"train-bridge": ["--layer", "1"], "evaluate": ["--bridge", "latest"], "export": ["pkg-out"]}


@pytest.mark.parametrize(
    "path",
    [
        "extract",
        "score",
        "train-bridge",
        "train-prior",
        "train-decoder",
        "evaluate",
        "generate",
        "sweep",
        "compare",
        "confirm",
        "export",
    ],
)
def test_every_command_default_path_dry_run(path, root, tmp_path, monkeypatch):
    """Each command with nothing but its required arguments: the builtin model and corpus, every default;
    on a cold cache it converts nothing (it loads no weights): the one file it may write there is the book of
    digests of the files its ids hash (stages/runtime/digests.py), as any run does. Before 2026-12-06 this
    asserted an empty cache, which held only where an earlier test of the worker had read the digest."""
    cache = tmp_path / "cold-cache"
    monkeypatch.setenv("DIHAL_CACHE", str(cache))
    res = invoke(path, *REQUIRED.get(path, []), "--dry-run")
    assert res.exit_code == 0, res.output
    assert "dry run" in res.output or "estimated size" in res.output
    assert {p.name for p in cache.rglob("*")} <= {"digests.json"}


@pytest.mark.slow
def test_sweep_without_layers_sweeps_every_candidate(tiny_dirs, root):
    args = ["sweep", "--model", str(tiny_dirs["llama"]), "--max-sequences", "24", "--seq-len", "16"]
    args += ["--train-steps", "3", "--width", "16", "--depth", "1", "--heads", "2", "--batch-size", "4"]
    args += ["--tokens", "128", "--eval-limit", "4", "--device", "cpu"]
    dry = invoke(*args, "--dry-run")
    assert dry.exit_code == 0 and "layers=(1, 2, 3)" in dry.output, dry.output  # the tiny model has 4 blocks
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    from dihal.artifacts.store import ArtifactStore

    art = ArtifactStore(root).resolve("latest", "sweep")
    assert list(art.config["layers"]) == [1, 2, 3]
    assert len(list(ArtifactStore(root).all("bridge"))) == 3


def test_every_stage_names_a_command_that_exists():
    """Error messages tell users to run `dihal <COMMANDS[stage]>`: each of those is a real command."""
    import importlib

    from dihal.artifacts.store import COMMANDS

    stages = (
        "extract",
        "score",
        "train_bridge",
        "train_prior",
        "train_decoder",
        "train_autoencoder",
        "evaluate",
        "generate",
        "sweep",
        "confirm",
        "compare",
    )
    assert {importlib.import_module(f"dihal.stages.{m}").STAGE for m in stages} == set(COMMANDS)
    assert set(COMMANDS.values()) <= set(_commands())


# -- the docs ---------------------------------------------------------------------------------------------
def _markdown() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_in_the_docs_resolves():
    """A link to a file (and to a heading, where it names one) finds it; web links are not followed."""
    import re

    def anchors(path: Path) -> set[str]:
        heads = [m.group(1) for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)]
        ids = set(re.findall(r'<a id="([^"]+)"></a>', path.read_text()))  # METHOD's stable anchors (§N)
        return {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in heads} | ids

    broken = []
    for page in _markdown():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_cli_reference_is_generated_from_the_app(tmp_path):
    """docs/cli.md is `typer dihal.cli.main utils docs`'s output; rerun it after changing an option."""
    import typer.cli

    out = tmp_path / "cli.md"
    runner = __import__("typer.testing", fromlist=["CliRunner"]).CliRunner()
    res = runner.invoke(typer.cli.app, ["dihal.cli.main", "utils", "docs", "--name", "dihal", "--output", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_text() == (ROOT / "docs" / "cli.md").read_text(), (
        "docs/cli.md is stale: typer dihal.cli.main utils docs --name dihal --output docs/cli.md"
    )


def test_method_is_cited_one_way_and_every_citation_names_a_section():
    """The code cites docs/method.md as `METHOD §N` (N a section with an anchor there), and no other way."""
    import re

    anchors = set(re.findall(r'<a id="s([\d.]+)"></a>', (ROOT / "docs" / "method.md").read_text()))
    assert {"0", "1", "2", "3", "4", "5", "5.1"} <= anchors
    other = re.compile(r"docs/method\.md,? sections?|METHOD (section )?\d|\(section \d")
    for folder in ("stages", "dihal_cli", "artifacts", "scripts", "benchmarks"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".sh"):
                continue
            text = path.read_text()
            where = path.relative_to(ROOT)
            assert not other.search(text), f"{where}: cite docs/method.md as METHOD §N ({other.search(text)[0]!r})"
            for cited in re.findall(r"METHOD §([\d.]*\d)", text):
                assert cited in anchors, f"{where} cites METHOD §{cited}, which docs/method.md has no anchor for"

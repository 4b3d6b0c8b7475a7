"""The backbone's own text as a dataset (issue 19): `dihal generate --baseline original-only`, then
`dihal extract --dataset generate:<ID>`, alone or mixed with a corpus by `--mix`."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from dihal.stages.text.data import is_validation
from tests.conftest import ROOT, forbid_model_loads, invoke, load_script

SEQ_LEN = 12


def _store() -> ArtifactStore:
    return ArtifactStore(os.environ["DIHAL_ROOT"])


def _own_samples(model_dir, *extra: str) -> str:
    res = invoke(
        "generate",
        "--baseline",
        "original-only",
        "--model",
        str(model_dir),
        "--num-samples",
        "24",
        "--max-new-tokens",
        str(SEQ_LEN - 1),
        "--batch-size",
        "8",
        *extra,
    )
    assert res.exit_code == 0, res.output
    return _store().resolve("latest", "generate").id


def _extract(model_dir, *args: str):
    res = invoke("extract", "--model", str(model_dir), "--layers", "0,1", "--seq-len", str(SEQ_LEN), *args)
    assert res.exit_code == 0, res.output
    return _store().resolve("latest", "extract")


def _chunks(docs: list[list[int]], start: int) -> list[list[int]]:
    """The corpus packing, written out: documents joined, cut into bodies of SEQ_LEN - 1 after the start."""
    flat = [t for d in docs for t in d]
    body = SEQ_LEN - 1
    return [[start] + flat[i : i + body] for i in range(0, len(flat) - body + 1, body)]


def test_a_generate_artifact_as_a_dataset_keeps_its_token_ids(tiny_dirs, root):
    gen_id = _own_samples(tiny_dirs["llama"])
    gen = _store().load("generate", gen_id)
    assert gen.manifest["parents"] == {} and gen.config["model"] == str(tiny_dirs["llama"])
    rows = [json.loads(line) for line in gen.file("samples.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and {r["model"] for r in rows} == {"original"}
    art = _extract(tiny_dirs["llama"], "--dataset", f"generate:{gen_id[:6]}")  # a prefix is resolved
    assert art.manifest["parents"] == {"generate": gen_id}  # the lineage names the model's text
    assert art.config["data"]["dataset"] == f"generate:{gen_id}"
    group = hs.open_group(art)
    ids, split = np.asarray(group["input_ids"][:]), np.asarray(group["split"][:])
    start, eos = 1, 2  # the tiny tokenizer's <bos> and <eos>
    docs = [r["token_ids"] + ([eos] if r["n_tokens"] < SEQ_LEN - 1 else []) for r in rows]
    for which in (0, 1):
        mine = [d for i, d in enumerate(docs) if is_validation(i, 0.1, 0) == bool(which)]
        assert ids[split == which].tolist() == _chunks(mine, start)
    assert (split == 1).any() and (split == 0).sum() >= 18


@pytest.mark.slow
def test_a_mix_draws_the_stated_shares(tiny_dirs, root):
    gen_id = _own_samples(tiny_dirs["llama"], "--max-new-tokens", "120", "--num-samples", "48")
    art = _extract(
        tiny_dirs["llama"],
        "--dataset",
        "pydoc",
        "--dataset",
        f"generate:{gen_id}",
        "--mix",
        "0.25,0.75",
        "--max-sequences",
        "80",
    )
    group = hs.open_group(art)
    ids, split = np.asarray(group["input_ids"][:]), np.asarray(group["split"][:])
    source = np.load(art.file("source.npy"))
    assert ids.shape == (80, SEQ_LEN) and source.shape == (80,)
    # 72 train and 8 validation sequences, each split 1 : 3, counted
    assert [int(((split == 0) & (source == s)).sum()) for s in (0, 1)] == [18, 54]
    assert [int(((split == 1) & (source == s)).sum()) for s in (0, 1)] == [2, 6]
    # and each sequence is from the source it is marked with: the generated ones are in the samples
    rows = [json.loads(line) for line in _store().load("generate", gen_id).file("samples.jsonl").open()]
    stream = [t for r in rows for t in r["token_ids"] + ([2] if r["n_tokens"] < 120 else [])]  # 2: <eos>
    written = {tuple(stream[i : i + 4]) for i in range(len(stream) - 3)}
    marked = [tuple(seq[1:5]) in written for seq in ids]
    assert all(np.asarray(marked)[source == 1]) and not any(np.asarray(marked)[source == 0])
    assert source[:20].tolist() != sorted(source[:20].tolist())  # the sources are interleaved, not in blocks
    sources = art.manifest["sources"]
    assert [(s["dataset"], s["share"], s["train"]) for s in sources] == [
        ("pydoc", 0.25, 18),
        (f"generate:{gen_id}", 0.75, 54),
    ]


def test_one_source_keeps_the_extract_id_of_before(tiny_dirs, root):
    from dihal.stages.configs import DataConfig, ExtractConfig
    from dihal.stages.extract import artifact_id_for, resolved_config

    cfg = ExtractConfig(model="smollm2-135m", data=DataConfig(max_sequences=64))
    assert "also" not in resolved_config(cfg)["data"] and "mix" not in resolved_config(cfg)["data"]
    assert artifact_id_for(cfg) != artifact_id_for(
        ExtractConfig(model="smollm2-135m", data=DataConfig(max_sequences=64, also=("x.txt",), mix=(0.5, 0.5)))
    )


def test_another_models_token_ids_are_refused(tiny_dirs, root):
    gen_id = _own_samples(tiny_dirs["qwen3"])
    res = invoke("extract", "--model", str(tiny_dirs["llama"]), "--layers", "0,1", "--dataset", f"generate:{gen_id}")
    assert res.exit_code == 2
    line = res.output.strip()
    assert line.startswith("error:") and "mean nothing to the tokenizer" in line and "\n" not in line
    assert f"--model {tiny_dirs['qwen3'].name}" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--dataset", "pydoc", "--mix", "1"), "--mix needs two or more --dataset sources"),
        (("--dataset", "pydoc", "--dataset", "a.txt", "--mix", "0.5,0.6"), "--mix shares must sum to 1"),
        (("--dataset", "pydoc", "--dataset", "a.txt", "--mix", "0.5"), "--mix gives 1 shares for 2"),
        (("--dataset", "pydoc", "--dataset", "a.txt", "--mix", "nan,0.5"), "--mix must be a finite number"),
        (("--dataset", "pydoc", "--dataset", "pydoc", "--mix", "0.5,0.5"), "names a source twice"),
        (("--dataset", "pydoc", "--dataset", "generate:nope", "--mix", "0.5,0.5"), "no generate artifact 'nope'"),
    ],
)
def test_bad_mixes_are_one_line(args, message, tiny_dirs, root):
    res = invoke("extract", "--model", str(tiny_dirs["llama"]), "--layers", "0,1", *args)
    assert res.exit_code == 2 and res.output.startswith("error:") and message in res.output, res.output


def test_original_only_needs_a_model_and_no_bridge(root):
    res = invoke("generate", "--baseline", "original-only")
    assert res.exit_code == 2 and "name it with --model" in res.output
    res = invoke("generate", "--baseline", "original-only", "--model", "smollm2-135m", "--bridge", "latest")
    assert res.exit_code == 2 and "give --model, not --bridge" in res.output
    res = invoke("generate", "--model", "smollm2-135m")
    assert res.exit_code == 2 and "--model is for --baseline original-only" in res.output


def test_a_mix_too_small_for_its_share_names_the_source(tiny_dirs, root):
    gen_id = _own_samples(tiny_dirs["llama"])  # 24 samples: about 21 training sequences
    res = invoke(
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--layers",
        "0,1",
        "--seq-len",
        str(SEQ_LEN),
        "--dataset",
        "pydoc",
        "--dataset",
        f"generate:{gen_id}",
        "--mix",
        "0.5,0.5",
        "--max-sequences",
        "200",
    )
    assert res.exit_code == 2 and f"dataset 'generate:{gen_id}' gives" in res.output
    assert "lower --max-sequences or its share (--mix, --own-text)" in res.output


def test_fidelity_on_own_samples_says_whether_the_bridge_was_trained_on_them(tiny_dirs, root):
    seen, unseen = _own_samples(tiny_dirs["llama"]), _own_samples(tiny_dirs["llama"], "--seed", "1")
    assert seen != unseen
    art = _extract(tiny_dirs["llama"], "--dataset", f"generate:{seen}")
    res = invoke(
        "train-bridge",
        "--layer",
        "1",
        "--extract",
        art.id,
        "--train-steps",
        "4",
        "--width",
        "16",
        "--depth",
        "1",
        "--heads",
        "2",
        "--batch-size",
        "4",
        "--eval-every",
        "2",
    )
    assert res.exit_code == 0, res.output
    bridge = _store().resolve("latest", "bridge").id
    held = {}
    for gen in (seen, unseen):
        res = invoke("evaluate", "--bridge", bridge, "--samples", gen, "--sample-steps", "1", "--limit", "4")
        assert res.exit_code == 0, res.output
        metrics = _store().resolve("latest", "evaluate").manifest["metrics"]
        held[gen] = (metrics["held_out"], metrics["source"])
    assert held[unseen][0] is True and "trained on" not in held[unseen][1]
    assert held[seen][0] is False and held[seen][1].endswith("which the bridge was trained on)")


def test_prompts_drawn_from_the_corpus_are_recorded_and_trained_on_as_read(tiny_dirs, root):
    from dihal.stages.configs import DataConfig
    from dihal.stages.text.data import documents

    gen_id = _own_samples(
        tiny_dirs["llama"],
        "--prompts-from",
        "pydoc",
        "--prompt-tokens",
        "4",
        "--num-prompts",
        "3",
        "--num-samples",
        "2",
        "--max-new-tokens",
        "6",
    )
    rows = [json.loads(line) for line in _store().load("generate", gen_id).file("samples.jsonl").open()]
    assert len(rows) == 6 and len({r["prompt"] for r in rows}) == 3
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    head = itertools.islice(documents(DataConfig()), 20)
    firsts = [tok.decode(tok(t, add_special_tokens=False)["input_ids"][:4]) for t in head]
    assert all(r["prompt"] in firsts for r in rows)  # each prompt opens a pydoc document
    assert all(r["prompt_ids"][0] == 1 and len(r["prompt_ids"]) >= 2 for r in rows)  # start token, then the prompt
    art = _extract(tiny_dirs["llama"], "--dataset", f"generate:{gen_id}", "--val-fraction", "0")
    ids = np.asarray(hs.open_group(art)["input_ids"][:])
    docs = [r["prompt_ids"][1:] + r["token_ids"] + ([2] if r["n_tokens"] < 6 else []) for r in rows]
    assert ids.tolist() == _chunks(docs, 1)
    res = invoke(
        "generate",
        "--baseline",
        "original-only",
        "--model",
        "smollm2-135m",
        "--prompts-from",
        "pydoc",
        "--prompt",
        "The",
    )
    assert res.exit_code == 2 and "not both" in res.output


TINY_NET = "--train-steps 2 --width 16 --depth 1 --heads 2 --batch-size 4 --eval-every 2".split()  # a 2-step bridge


def test_fidelity_on_another_extracts_validation_split_checks_it_is_unseen(tiny_dirs, root):
    bridge_extract = _extract(tiny_dirs["llama"], "--max-sequences", "40")
    res = invoke(
        "train-bridge",
        "--layer",
        "1",
        "--extract",
        bridge_extract.id,
        *TINY_NET,
    )
    assert res.exit_code == 0, res.output
    bridge = _store().resolve("latest", "bridge").id
    same_split = _extract(tiny_dirs["llama"], "--max-sequences", "80")  # the same documents are held out
    reshuffled = _extract(tiny_dirs["llama"], "--max-sequences", "80", "--seed", "3")  # others are
    other_len = invoke(
        "extract", "--model", str(tiny_dirs["llama"]), "--layers", "0,1", "--seq-len", "8", "--max-sequences", "20"
    )
    assert other_len.exit_code == 0
    found = {}
    for extract in (same_split.id, reshuffled.id, bridge_extract.id):
        res = invoke("evaluate", "--bridge", bridge, "--extract", extract, "--sample-steps", "1", "--limit", "8")
        assert res.exit_code == 0, res.output
        art = _store().resolve("latest", "evaluate")
        found[extract] = (art.manifest["metrics"]["held_out"], art.manifest["parents"].get("extract"), art.id)
    assert found[same_split.id][:2] == (True, same_split.id)
    assert found[reshuffled.id][:2] == (False, reshuffled.id)  # its validation split holds training sequences
    plain = invoke("evaluate", "--bridge", bridge, "--sample-steps", "1", "--limit", "8")
    assert plain.exit_code == 0
    assert found[bridge_extract.id] == (True, None, _store().resolve("latest", "evaluate").id)  # the default
    res = invoke("evaluate", "--bridge", bridge, "--extract", "latest", "--sample-steps", "1")
    assert res.exit_code == 2 and "is not of the bridge's model and --seq-len" in res.output  # shorter: refused


BRIDGE = [
    "train-bridge",
    "--layer",
    "1",
    "--seq-len",
    str(SEQ_LEN),
    *TINY_NET,
]


@pytest.mark.slow
def test_own_text_trains_the_bridge_on_the_backbones_own_samples_at_its_share(tiny_dirs, root):
    model = ["--model", str(tiny_dirs["llama"]), "--max-sequences", "40"]
    own = ["--own-text", "0.5", "--own-samples", "48"]
    plan = invoke(*BRIDGE, *model, *own, "--dry-run")
    assert plan.exit_code == 0, plan.output
    res = invoke(*BRIDGE, *model, *own)
    assert res.exit_code == 0, res.output
    store = _store()
    bridge = store.resolve("latest", "bridge")
    extract = store.load("extract", bridge.manifest["parents"]["extract"])
    gen = store.load("generate", extract.manifest["parents"]["generate"])
    # the samples: the original backbone alone, unprompted, one extract sequence long, at the recipe's seed
    assert (gen.config["baseline"], gen.config["model"], gen.config["prompts"]) == (
        "original-only",
        str(tiny_dirs["llama"]),
        [],
    )
    assert (gen.config["num_samples"], gen.config["max_new_tokens"], gen.config["seed"]) == (48, SEQ_LEN - 1, 100)
    data = extract.config["data"]
    assert (data["dataset"], data["also"], data["mix"]) == ("pydoc", [f"generate:{gen.id}"], [0.5, 0.5])
    assert f"also=('generate:{gen.id}',)" in plan.output  # the dry run named the samples it then made
    split, source = (
        np.asarray(hs.open_group(extract)["split"][:]),
        np.load(extract.file("source.npy")),
    )
    assert [int(((split == 0) & (source == s)).sum()) for s in (0, 1)] == [18, 18]  # 36 train sequences, halved
    again = invoke(*BRIDGE, *model, *own)
    assert again.exit_code == 0 and "started" not in again.output  # samples, extract and bridge all reused
    assert again.output.count("cache hit") == 2, again.output
    # all of it the model's own text: the samples are the only source
    res = invoke(*BRIDGE, "--model", str(tiny_dirs["llama"]), "--own-text", "1", "--own-samples", "48")
    assert res.exit_code == 0, res.output
    extract = store.load("extract", store.resolve("latest", "bridge").manifest["parents"]["extract"])
    assert (extract.config["data"]["dataset"], extract.config["data"].get("also", [])) == (f"generate:{gen.id}", [])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--own-text", "1.5"), "--own-text must be a share in [0, 1]"),
        (("--own-text", "nan"), "--own-text must be a finite number"),
        (("--own-text", "0.5", "--own-samples", "0"), "--own-samples must be at least 1"),
        (("--own-text", "0.5", "--extract", "latest"), "--own-text makes the extract; leave out --extract"),
    ],
)
def test_bad_own_text_is_one_line(args, message, tiny_dirs, root):
    res = invoke(*BRIDGE, "--model", str(tiny_dirs["llama"]), *args)
    assert res.exit_code == 2 and res.output.startswith("error:") and message in res.output, res.output
    assert res.output.count("\n") == 1


def test_own_text_scales_a_given_mix_and_leaves_share_zero_alone():
    from dihal.stages.configs import DataConfig, ExtractConfig, OwnTextConfig
    from dihal.stages.own_text import with_samples

    ecfg = ExtractConfig(data=DataConfig(dataset="pydoc", also=("a.txt",), mix=(0.25, 0.75)))
    data = with_samples(ecfg, OwnTextConfig(own_text=0.5), "abc").data
    assert (data.sources, data.mix) == (("pydoc", "a.txt", "generate:abc"), (0.125, 0.375, 0.5))
    assert with_samples(ecfg, OwnTextConfig(), "abc") == ecfg


def test_own_text_sh_refuses_an_unknown_arm_before_any_work(tmp_path):
    """scripts/own_text.sh checks ARMS first: a misspelt arm is one error line and exit 2, and the root it
    would have filled is never made (its samples alone take a quarter of an hour)."""
    import subprocess

    root = tmp_path / "never"
    env = {**os.environ, "ARMS": "pydoc recipie", "DIHAL_ROOT": str(root)}
    proc = subprocess.run(
        ["bash", "scripts/own_text.sh", "smollm2-135m"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "error: ARMS holds pydoc, own, mix or recipe, not 'recipie'"
    assert not root.exists() and proc.stdout == ""


def test_own_text_py_pools_earlier_rows_of_bridges_the_store_does_not_hold(tmp_path):
    """Rows kept from an earlier session (benchmarks/own_text/MODEL) join this store's; a bridge in both
    keeps the store's numbers, and rows of another backbone are refused with one error line."""
    import pandas as pd

    own_text = load_script("own_text")
    here = pd.DataFrame([{"data": "mix", "seed": 0, "model": "m", "bridge": "a", "ppl_ratio own": 1.4}])
    earlier = pd.DataFrame(
        [
            {"data": "mix", "seed": 0, "model": "m", "bridge": "a", "ppl_ratio own": 9.0},  # stale: the store wins
            {"data": "mix", "seed": 1, "model": "m", "bridge": "b", "ppl_ratio own": 1.5},
        ]
    )
    earlier.to_csv(tmp_path / "own_text.csv", index=False)
    pooled = own_text.pool(here, tmp_path, "own_text.csv")
    assert sorted(zip(pooled["bridge"], pooled["ppl_ratio own"])) == [("a", 1.4), ("b", 1.5)]
    assert own_text.pool(here, None, "own_text.csv") is here
    earlier.assign(model="other").to_csv(tmp_path / "own_text.csv", index=False)
    with pytest.raises(SystemExit, match=r"^error: --earlier .* is of m, other; pool rows of one backbone only$"):
        own_text.pool(here, tmp_path, "own_text.csv")
    with pytest.raises(SystemExit, match=r"^error: --earlier .* holds no own_text_kl_by_position.csv"):
        own_text.pool(here, tmp_path, "own_text_kl_by_position.csv")
    earlier.drop(columns=["model", "bridge"]).to_csv(tmp_path / "own_text.csv", index=False)
    with pytest.raises(SystemExit, match=r"^error: .*own_text.csv has no model or bridge column; rerun own_text.py"):
        own_text.pool(here, tmp_path, "own_text.csv")


@pytest.mark.parametrize("name", ["own_text.csv", "own_text_kl_by_position.csv"])
def test_rows_kept_in_benchmarks_pool_with_a_store_of_their_backbone(name):
    """What scripts/own_text.sh passes as --earlier: every kept folder's rows are of one backbone, one per bridge
    (per bridge and position bin for the KL), and pool in beside a store row of that backbone."""
    import pandas as pd

    own_text = load_script("own_text")
    folders = sorted((ROOT / "benchmarks" / "own_text").iterdir())
    assert folders, "no rows kept under benchmarks/own_text"
    for folder in folders:
        kept = pd.read_csv(folder / name)
        assert set(kept["model"]) == {folder.name}
        keys = ["bridge"] + (["positions"] if "positions" in kept else [])
        assert not kept.duplicated(keys).any()
        here = kept.iloc[:1].assign(bridge="new")
        pooled = own_text.pool(here, folder, name)
        assert len(pooled) == len(kept) + 1


def test_own_text_py_gives_a_bridge_off_the_recipe_a_row_of_its_own():
    """A bridge whose steps, width, depth or lr differ from its protocol's, or whose extract is not the script's
    896 sequences, is labelled with what differs, so it never pools into the recipe's seeds."""
    from types import SimpleNamespace

    from dihal.stages.configs import PROTOCOLS

    own_text = load_script("own_text")
    recipe = {k: PROTOCOLS["cpu-small"][k] for k in ("steps", "width", "depth", "lr")}

    def label(n=896, **changed):
        bridge = SimpleNamespace(config={"protocol": "cpu-small", **recipe, **changed})
        extract = SimpleNamespace(
            config={"data": {"dataset": "generate:abc", "also": []}}, manifest={"metrics": {"n_sequences": n}}
        )
        return own_text.label(bridge, extract)

    assert label() == "own"
    assert label(steps=2000) == "own, 2000 steps"
    assert label(width=512, lr=5e-4) == "own, 512 width, 0.0005 lr"
    assert label(n=1954) == "own, 1954 seqs"


def _split_of(index: int, fraction: float = 0.1, seed: int = 0) -> int:
    """docs/method.md section 0's rule, written out: 1 (validation) when the hash of seed:index falls below
    the fraction."""
    import hashlib

    return int(int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "big") / 2**64 < fraction)


def test_too_few_own_samples_fail_in_the_plan_before_any_model_loads(tiny_dirs, root, no_model_loads):
    """Before, 256 samples were written (2 minutes on smollm2-135m) and only then did the mix say they were
    too few. Now the plan knows: a sample is one document, whose split is a hash of its index, and gives at
    most one sequence. No model may load (no_model_loads fails the test if one does)."""
    args = [*BRIDGE, "--model", str(tiny_dirs["llama"]), "--max-sequences", "40", "--own-text", "0.5"]
    train_docs = sum(1 - _split_of(i) for i in range(8))
    for extra in ([], ["--dry-run"]):
        res = invoke(*args, "--own-samples", "8", *extra)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        line = res.output.strip().splitlines()[-1]
        assert line.startswith(
            f"error: --own-samples 8 give at most {train_docs} training sequences, but --own-text 0.5 of "
            "--max-sequences 40 asks 18 of them; use --own-samples "
        ), line
        assert "(or auto), or --max-sequences " in line
    assert ArtifactStore(root).all() == []  # nothing written either


def test_own_samples_auto_is_sized_from_the_share_with_a_margin(tiny_dirs, root):
    """auto: the fewest samples whose documents, counted at 0.8 of a sequence each, cover the mix's ask of
    each split (here 18 train and 2 validation sequences of --max-sequences 40 at 0.5)."""
    n, have = 0, [0, 0]
    while have[0] * 0.8 < 18 or have[1] * 0.8 < 2:
        have[_split_of(n)] += 1
        n += 1
    res = invoke(*BRIDGE, "--model", str(tiny_dirs["llama"]), "--max-sequences", "40", "--own-text", "0.5", "--dry-run")
    assert res.exit_code == 0, res.output
    assert f"num_samples={n}," in res.output and "warning" not in res.output
    unsized = invoke(*BRIDGE, "--model", str(tiny_dirs["llama"]), "--own-text", "0.5", "--dry-run")
    assert "num_samples=1024," in unsized.output  # no --max-sequences: the measured recipe's 1024, its ids kept
    bad = invoke(*BRIDGE, "--model", str(tiny_dirs["llama"]), "--own-text", "0.5", "--own-samples", "lots")
    assert bad.exit_code == 2 and "cannot read --own-samples 'lots'; use a whole number or auto" in bad.output


def test_existing_samples_are_counted_exactly_as_the_extract_packs_them(tiny_dirs, root, monkeypatch):
    from dihal.stages.configs import DataConfig
    from dihal.stages.extract import given_sequences

    gen = [
        "generate",
        "--baseline",
        "original-only",
        "--model",
        str(tiny_dirs["llama"]),
        "--num-samples",
        "40",
        "--max-new-tokens",
        str(SEQ_LEN - 1),
        "--seed",
        "100",
        "--device",
        "cpu",
    ]
    assert invoke(*gen).exit_code == 0
    store = _store()
    samples = store.resolve("latest", "generate")
    ex = [
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--dataset",
        f"generate:{samples.id}",
        "--layers",
        "0,1",
        "--seq-len",
        str(SEQ_LEN),
        "--device",
        "cpu",
    ]
    assert invoke(*ex).exit_code == 0
    metrics = store.resolve("latest", "extract").manifest["metrics"]
    counted = given_sequences(samples, DataConfig(seq_len=SEQ_LEN))
    assert counted == (metrics["n_train"], metrics["n_validation"])
    # so a mix that asks more of them than they hold fails before any model loads (it failed after, in packing)
    forbid_model_loads(monkeypatch)
    m = 4 * sum(counted) + 8
    asks = (m - round(m * 0.1)) // 2
    mixed = [*ex[:4], "pydoc", "--dataset", *ex[4:], "--mix", "0.5,0.5", "--max-sequences", str(m)]
    for extra in ([], ["--dry-run"]):
        res = invoke(*mixed, *extra)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert res.output.strip().splitlines()[-1] == (
            f"error: dataset 'generate:{samples.id}' gives {counted[0]} training sequences but the mix asks "
            f"{asks} of it; lower --max-sequences or its share (--mix, --own-text)"
        )

"""dihal confirm (claim 4): l*, the oracle and the worst layer of a sweep, fully trained per seed."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from dihal.artifacts.store import ArtifactStore
from tests.conftest import invoke

SMALL = ["--width", "16", "--depth", "1", "--device", "cpu"]


@pytest.mark.slow
def test_confirm_trains_the_sweeps_layers_per_seed_and_scores_them(tiny_dirs, root):
    ex = ["extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "24", "--seq-len", "12"]
    assert invoke(*ex, "--val-fraction", "0.25", "--device", "cpu").exit_code == 0
    sweep = invoke(
        "sweep",
        "--extract",
        "latest",
        "--layers",
        "1,2,3",
        "--tokens",
        "100",
        "--train-steps",
        "3",
        "--batch-size",
        "4",
        "--eval-limit",
        "2",
        *SMALL,
    )
    assert sweep.exit_code == 0, sweep.output
    store = ArtifactStore(root)
    summary = store.resolve("latest", "sweep").manifest["metrics"]
    res = invoke(
        "confirm",
        "--protocol",
        "sweep-tiny",
        "--train-steps",
        "4",
        "--train-batch",
        "4",
        "--seeds",
        "0,1",
        "--num-samples",
        "3",
        "--eval-limit",
        "2",
        "--sample-steps",
        "2",
        "--evaluator",
        str(tiny_dirs["qwen3"]),
        *SMALL,
    )
    assert res.exit_code == 0, res.output
    assert "claim 4" in res.output and "…" not in res.output  # the tables' cells are whole at 80 columns
    art = store.resolve("latest", "confirm")
    runs = pd.read_csv(art.file("confirm_runs.csv"))
    named = {"l_star": summary["l_star"], "oracle": summary["oracle_layer"], "worst": summary["worst_layer"]}
    expected = {}
    for name, layer in named.items():
        expected.setdefault(layer, []).append(name)
    assert {int(k): v for k, v in art.manifest["metrics"]["layers"].items()} == {
        layer: "=".join(names) for layer, names in expected.items()
    }
    assert len(runs) == 2 * len(expected) and sorted(runs["seed"].unique()) == [0, 1]
    # every number comes from the artifacts it names: the bridge's val loss, the evaluations' Gen.PPL
    bridges = {(b.config["layer"], b.config["seed"]): b for b in store.all("bridge") if b.config["steps"] == 4}
    for r in runs.to_dict("records"):
        bridge = bridges[(r["layer"], r["seed"])]
        assert r["val_loss"] == pytest.approx(bridge.manifest["metrics"]["val_loss"])
        gens = [g for g in store.all("generate") if g.manifest["parents"]["bridge"] == bridge.id]
        assert len(gens) == 1 and len(gens[0].file("samples.jsonl").read_text().splitlines()) == 3
        evals = {
            e.config["evaluator"]: e
            for e in store.all("evaluate")
            if e.manifest["parents"].get("generate") == gens[0].id
        }
        assert r["gen_ppl_token_evaluator"] == pytest.approx(
            evals[str(tiny_dirs["qwen3"])].manifest["metrics"]["rows"][0]["gen_ppl_token"]
        )
        assert r["gen_ppl_token_backbone"] == pytest.approx(
            evals[str(tiny_dirs["llama"])].manifest["metrics"]["rows"][0]["gen_ppl_token"]
        )
    table = pd.read_csv(art.file("confirm.csv")).set_index("layer")
    for layer, group in runs.groupby("layer"):
        assert table.loc[layer, "kl_mean"] == pytest.approx(group["kl"].mean())
        assert table.loc[layer, "val_loss_std"] == pytest.approx(np.std(group["val_loss"], ddof=1))
    assert json.loads(art.file("confirm.json").read_text())["evaluator"] == str(tiny_dirs["qwen3"])
    # the claims table reads the same artifacts
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = root / "claims.md"
    proc = subprocess.run(
        [sys.executable, "scripts/summarize.py", "--claims", str(out), str(root)], cwd=ROOT, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    assert f"ours: {tiny_dirs['llama']} ({root})" in lines[2]  # a column per root, named by its backbone
    claim = {int(line[2]): line for line in lines if line[:3] in ("| 1", "| 2", "| 3", "| 4")}
    assert "**not shown (interval reaches 0 or was not computed)**" in claim[1]  # one seed, no score draws
    lo, hi = summary["shallow_window"]
    shallow, near = lo <= summary["l_star"] <= hi, summary["l_star_loss_rank"] <= 3
    verdict = "holds" if shallow and near else ("partly" if shallow or near else "does not hold")
    assert f"l* = {summary['l_star']}" in claim[2] and f"**{verdict}**" in claim[2]
    assert 3 not in claim  # claim 3 (compare) was not run here: the table shows only claims that were
    star = table.set_index("label").filter(like="l_star", axis=0).iloc[0]
    assert f"ppl ratio {star['ppl_ratio_mean']:.3f}" in claim[4]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--at", "best"], "cannot read --at 'best'"),
        (["--seeds", "0,0"], "--seeds must name distinct seeds"),
        (["--num-samples", "0"], "--num-samples must be at least 1"),
        (["--protocol", "nope"], "unknown --protocol 'nope'"),
    ],
)
def test_confirm_bad_input(root, args, needle):
    res = invoke("confirm", *args)
    assert res.exit_code == 2 and needle in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_confirm_without_a_sweep_names_the_command(root):
    res = invoke("confirm")
    assert res.exit_code == 2 and "run `dihal sweep` first" in res.output, res.output


@pytest.mark.slow
def test_fidelity_beyond_the_training_text_on_a_dataset_and_on_the_backbones_samples(tiny_dirs, root, tmp_path):
    """evaluate --bridge --dataset packs the other corpus as the extract packs its own and measures what
    evaluate_fidelity measures on that packing (itself checked against plain torch in tests/test_checks.py);
    --bridge --samples measures on the original model's samples;
    both write the per-position breakdown."""
    import torch

    from dihal.stages import evaluate as ev
    from dihal.stages import train_bridge as bstage
    from dihal.stages.fidelity import evaluate_fidelity
    from dihal.stages.lm.models import load_model
    from dihal.stages.parts.bridge import Bridge
    from dihal.stages.text.data import DataConfig, pack

    ex = ["extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "24", "--seq-len", "12", "--layers", "0,2"]
    assert invoke(*ex, "--device", "cpu").exit_code == 0
    store = ArtifactStore(root)
    cfg = bstage.BridgeConfig.from_protocol("sweep-tiny", layer=2, steps=4, width=16, depth=1, batch_size=8)
    bridge_art = bstage.run(cfg, store.resolve("latest", "extract"), store)
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"Zebra {i} quietly counts {i * 7} stones by the river." for i in range(60)))
    res = invoke(
        "evaluate",
        "--bridge",
        bridge_art.id,
        "--dataset",
        str(other),
        "--limit",
        "4",
        "--sample-steps",
        "1,2",
        "--json",
        "--device",
        "cpu",
    )
    assert res.exit_code == 0, res.output
    art = store.resolve(json.loads(res.output)["id"], "evaluate")
    m = art.manifest["metrics"]
    assert m["source"] == f"dataset {other}" and m["n_sequences"] == 4 and m["seq_len"] == 12
    loaded = load_model(str(tiny_dirs["llama"]), "cpu", "float32")
    ids = pack(DataConfig(dataset=str(other), seq_len=12, max_sequences=4, val_fraction=0.0), loaded.tokenizer)
    direct = evaluate_fidelity(
        loaded.model, Bridge.load(bridge_art), torch.from_numpy(ids.input_ids.astype("int64")), [1, 2], 16, 0
    )
    for row in m["fidelity"]:
        assert row["kl"] == pytest.approx(direct[row["steps"]].metrics()["kl"], rel=1e-5)
    by_pos = pd.read_csv(art.file("fidelity_by_position.csv"))
    assert sorted(by_pos["steps"].unique()) == [1, 2] and by_pos.groupby("steps")["position"].apply(list).iloc[
        0
    ] == list(range(1, 12))
    # the backbone's own samples
    gen = invoke(
        "generate",
        "--bridge",
        bridge_art.id,
        "--num-samples",
        "3",
        "--max-new-tokens",
        "11",
        "--baseline",
        "original",
        "--device",
        "cpu",
    )
    assert gen.exit_code == 0, gen.output
    gen_art = store.resolve("latest", "generate")
    res = invoke("evaluate", "--bridge", bridge_art.id, "--samples", gen_art.id, "--sample-steps", "2", "--json")
    assert res.exit_code == 0, res.output
    art = store.resolve(json.loads(res.output)["id"], "evaluate")
    assert art.manifest["metrics"]["source"] == f"generate {gen_art.id} (samples_original.jsonl)"
    assert art.manifest["parents"] == {"bridge": bridge_art.id, "generate": gen_art.id}
    groups = ev.sample_ids(gen_art, loaded.tokenizer, 12, 64)[0]
    originals = [json.loads(line) for line in gen_art.file("samples_original.jsonl").read_text().splitlines()]
    lengths = sorted((1 + len(o["token_ids"]) for o in originals), reverse=True)  # the start token, then each
    assert [n for g in groups for n in [g.shape[1]] * g.shape[0]] == lengths
    assert all((g[:, 0] == loaded.tokenizer.bos_token_id).all() for g in groups)
    assert art.manifest["metrics"]["n_sequences"] == 3 and art.manifest["metrics"]["seq_len"] == lengths[0]
    direct = evaluate_fidelity(loaded.model, Bridge.load(bridge_art), groups, [2], 16, 0)[2].metrics()
    assert art.manifest["metrics"]["fidelity"][0]["top1_agreement"] == pytest.approx(direct["top1_agreement"])
    bad = invoke("evaluate", "--dataset", str(other))
    assert bad.exit_code == 2 and "give --bridge ID with it" in bad.output
    missing = invoke("evaluate", "--bridge", bridge_art.id, "--dataset", str(tmp_path / "nope.txt"))
    assert missing.exit_code == 2 and len(missing.output.strip().splitlines()) == 1, missing.output

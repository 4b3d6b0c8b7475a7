"""dihal.api (docs/api.md) and the hybrid as a transformers causal LM (stages/hybrid_lm.py): its logits are
fidelity's, its generate is `dihal generate`'s, padding changes nothing, and bad input is one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import dihal
from dihal.artifacts.errors import DihalError
from tests.conftest import ROOT, invoke, shared

TINY_BRIDGE = ["--protocol", "sweep-tiny", "--width", "16", "--depth", "1", "--heads", "2", "--batch-size", "4"]


@pytest.fixture(scope="session")
def api_stores(tiny_dirs, tmp_path_factory):
    """{kind: store} with extract -> score -> bridge at layer 2 (6 steps), for a BOS model (llama) and a
    model without BOS (qwen3), made once per session for all workers; 64 positions, so the local MC task's
    continuations (up to 46 tokens of the tiny tokenizer) fit."""
    kinds = ("llama", "qwen3")

    def build(folder):
        for kind in kinds:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("DIHAL_ROOT", str(folder / kind))
                extract = ["extract", "--model", str(tiny_dirs[kind]), "--max-sequences", "24", "--seq-len", "64"]
                ok = invoke(*extract, "--val-fraction", "0.25", "--layers", "0-3", "--device", "cpu")
                assert ok.exit_code == 0, ok.output
                score = ["score", "--extract", "latest", "--tokens", "40", "--k", "4", "--candidates", "1,2"]
                assert invoke(*score, "--pairs", "50").exit_code == 0
                res = invoke("train-bridge", "--layer", "2", "--extract", "latest", *TINY_BRIDGE, "--train-steps", "6")
                assert res.exit_code == 0, res.output

    folder = shared(tmp_path_factory, "api", build)
    return {kind: folder / kind for kind in kinds}


@pytest.fixture()
def store_of(api_stores, root):
    def copy(kind: str = "llama"):
        shutil.copytree(api_stores[kind], root)
        return dihal.open_store(root)

    return copy


def test_store_lists_loads_and_reads_a_score_table(store_of):
    store = store_of()
    runs = store.runs()
    # the bridge's layer moments (stages/moments.py) are made while it trains, a child of the extract
    assert list(runs["stage"]) == ["extract", "score", "bridge", "moments"] and set(runs["status"]) == {"complete"}
    assert store.load("latest", "moments").manifest["parents"] == {"extract": runs["id"].iloc[0]}
    assert list(store.runs("bridge")["layer"]) == [2]
    bridge = store.load("latest", "bridge")
    assert bridge.stage == "bridge" and bridge.id == runs["id"].iloc[2]
    assert store.load(bridge.id[:5]).id == bridge.id  # a unique prefix, as the CLI takes it
    assert bridge.manifest["parents"]["extract"] == runs["id"].iloc[0]
    assert "weights_ema.safetensors" in bridge.paths and bridge.paths["bridge.json"].is_file()
    table = dihal.score_table("latest", root=store.root)
    written = (store.load("latest", "score").path / "table.csv").read_text().splitlines()
    assert len(table) == len(written) - 1 and list(table.columns) == written[0].split(",")
    assert table["layer"].tolist() == sorted(table["layer"].tolist())


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hybrid_logits_are_the_ones_fidelity_uses(kind, store_of, monkeypatch):
    """evaluate's fidelity (stages/fidelity.py, one sequence at a time, seed 0) against forward: the
    logits fidelity computes from the hybrid's final states, captured as it computes them."""
    from dihal.stages import evaluate, fidelity

    store = store_of(kind)
    hybrid = dihal.load_hybrid("latest", root=store.root)
    ids = evaluate.validation_ids(store.load("latest", "extract").artifact, 2)
    seen = []
    real_add = fidelity.FidelityTotals.add

    def capture(self, h_hat, h, mu, logits, hidden_h, *rest, **kw):
        seen.append(logits(hidden_h))
        return real_add(self, h_hat, h, mu, logits, hidden_h, *rest, **kw)

    monkeypatch.setattr(fidelity.FidelityTotals, "add", capture)
    fidelity.evaluate_fidelity(hybrid.backbone, hybrid.bridge, ids[:1], [hybrid.config.steps], batch_size=1)
    out = hybrid(input_ids=ids[:1])
    transformers = __import__("transformers")
    assert isinstance(hybrid, transformers.PreTrainedModel) and isinstance(hybrid, transformers.GenerationMixin)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
    assert out.logits.shape == (1, ids.shape[1], hybrid.config.vocab_size)
    torch.testing.assert_close(out.logits[:, 1:], seen[0][:, 1:], atol=1e-5, rtol=0)
    labels = ids[:1].clone()
    by_hand = torch.nn.functional.cross_entropy(out.logits[0, :-1], labels[0, 1:])
    assert torch.isclose(hybrid(input_ids=ids[:1], labels=labels).loss, by_hand)


def test_padding_on_either_side_and_the_batch_change_no_logits(store_of):
    store = store_of()
    hybrid = dihal.load_hybrid("latest", root=store.root)
    ids = torch.randint(3, hybrid.config.vocab_size, (3, 16))
    ids[:, 0] = hybrid.start_id
    alone = [hybrid(input_ids=ids[r : r + 1]).logits[0] for r in range(3)]
    short = ids[1, :9]
    pad = hybrid.config.pad_token_id or 0
    for side in ("left", "right"):
        padded = ids.clone()
        mask = torch.ones_like(ids)
        if side == "left":
            padded[1] = torch.cat([torch.full((7,), pad), short])
            mask[1, :7] = 0
            real = slice(7, 16)
        else:
            padded[1] = torch.cat([short, torch.full((7,), pad)])
            mask[1, 9:] = 0
            real = slice(0, 9)
        out = hybrid(input_ids=padded, attention_mask=mask).logits
        torch.testing.assert_close(out[1, real], hybrid(input_ids=short[None]).logits[0], atol=1e-5, rtol=0)
        for r in (0, 2):
            torch.testing.assert_close(out[r], alone[r], atol=1e-5, rtol=0)
    # causal: a prefix's logits do not depend on the tokens after it
    torch.testing.assert_close(hybrid(input_ids=ids[:1, :9]).logits[0], alone[0][:9], atol=1e-5, rtol=0)


def test_a_first_token_other_than_the_start_token_gets_its_exact_state(store_of):
    """Position 0 is not the bridge's: the original's state of that token alone (lm-eval starts without BOS)."""
    from dihal.stages.lm.capture import hidden_states

    store = store_of()
    hybrid = dihal.load_hybrid("latest", root=store.root)
    ids = torch.tensor([[hybrid.start_id, 40, 41, 42], [40, 41, 42, 43]])
    states = hybrid.layer_states(ids, torch.ones_like(ids, dtype=torch.bool))
    torch.testing.assert_close(states[0, 0], hybrid.bridge.norm.pos0.reshape(-1).float())
    exact = hidden_states(hybrid.backbone, ids[1:, :1], [2])[2][0, 0].float()
    torch.testing.assert_close(states[1, 0], exact)
    assert not torch.equal(states[0, 0], states[1, 0])


def test_hybrid_generate_writes_what_dihal_generate_writes(store_of, root):
    store = store_of()
    bridge = store.load("latest", "bridge")
    args = ["--prompt", "The class", "--num-samples", "3", "--max-new-tokens", "6", "--seed", "5", "--batch-size", "2"]
    assert invoke("generate", "--bridge", bridge.id, *args, "--temperature", "0.8", "--device", "cpu").exit_code == 0
    rows = [
        json.loads(line) for line in store.load("latest", "generate").paths["samples.jsonl"].read_text().splitlines()
    ]
    hybrid = dihal.load_hybrid(bridge.id, root=root)
    out = hybrid.generate("The class", max_new_tokens=6, temperature=0.8, seed=5, num_samples=3, batch_size=2)
    assert out.token_ids == [r["token_ids"] for r in rows] and out.texts == [r["text"] for r in rows]
    # GenerationMixin's arguments: token ids in, prompt and new ids out; greedy is the argmax of forward
    prompt = torch.tensor([[hybrid.start_id, 40, 41]])
    ids = hybrid.generate(input_ids=prompt, max_new_tokens=1, do_sample=False)
    assert ids.shape == (1, 4) and torch.equal(ids[:, :3], prompt)
    assert int(ids[0, 3]) == int(hybrid(input_ids=prompt).logits[0, -1].argmax())


def test_bad_input_is_one_line(store_of, monkeypatch):
    store = store_of()
    extract = store.load("latest", "extract")
    with pytest.raises(DihalError, match=f"^extract/{extract.id} is not a bridge artifact; give a bridge id$"):
        dihal.load_hybrid(extract.id, root=store.root)
    with pytest.raises(DihalError, match="^no bridge artifact 'ffff' under .*; `dihal runs list` shows what exists$"):
        dihal.load_hybrid("ffff", root=store.root)
    with pytest.raises(DihalError, match="^no artifact store at .*nowhere; run a `dihal` command"):
        dihal.open_store(store.root / "nowhere")
    with pytest.raises(DihalError, match="torch sees no CUDA device"):
        dihal.load_hybrid("latest", root=store.root, device="cuda")
    # a device without the dtype's kernels (torch before 2.1 had no float16 layer norm on CPU)
    real = torch.nn.functional.layer_norm

    def old_cpu(x, *a, **k):
        if x.dtype == torch.float16:
            raise RuntimeError("\"LayerNormKernelImpl\" not implemented for 'Half'")
        return real(x, *a, **k)

    monkeypatch.setattr(torch.nn.functional, "layer_norm", old_cpu)
    with pytest.raises(
        DihalError, match="^device cpu cannot run float16 .*LayerNormKernelImpl.*; use --dtype float32$"
    ):
        dihal.load_hybrid("latest", root=store.root, dtype="float16")
    monkeypatch.undo()
    hybrid = dihal.load_hybrid("latest", root=store.root)
    ids = torch.tensor([[hybrid.start_id, 40, 41]])
    with pytest.raises(DihalError, match=r"^attention_mask has shape \(1, 2\) and input_ids \(1, 3\)"):
        hybrid(input_ids=ids, attention_mask=torch.ones(1, 2))
    with pytest.raises(DihalError, match="gap inside a row"):
        hybrid(input_ids=ids, attention_mask=torch.tensor([[1, 0, 1]]))


# -- lm-evaluation-harness ------------------------------------------------------------------------------------
TASKS = ROOT / "tests" / "data" / "lm_eval"
LM_EVAL = ["--lm-eval", "dihal_pydoc_mc,dihal_pydoc_ppl", "--lm-eval-include", str(TASKS), "--device", "cpu"]


def _by_hand_accuracy(model, tokenizer, max_length: int) -> float:
    """The MC task's accuracy from the model's own logits, as the harness defines it (docs: loglikelihood of
    each choice after the context, the last max_length tokens kept, the highest wins)."""
    docs = [json.loads(line) for line in (TASKS / "pydoc_mc.jsonl").read_text().splitlines()]
    right = 0
    for doc in docs:
        scores = []
        context = tokenizer(doc["context"], add_special_tokens=False)["input_ids"]
        for choice in doc["choices"]:
            whole = tokenizer(doc["context"] + choice, add_special_tokens=False)["input_ids"]
            cont = whole[len(context) :]
            ids = (context + cont)[-(max_length + 1) :][:-1]
            logits = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
            scores.append(float(logits[-len(cont) :].gather(-1, torch.tensor(cont)[:, None]).sum()))
        right += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    return right / len(docs)


@pytest.mark.slow
def test_lm_eval_scores_the_hybrid_and_its_backbone_on_local_tasks(store_of, root, monkeypatch):
    store = store_of()
    res = invoke("evaluate", "--bridge", "latest", *LM_EVAL)
    assert res.exit_code == 0, res.output
    art = store.load("latest", "evaluate")
    assert art.config["kind"] == "lm_eval" and art.manifest["metrics"]["max_length"] == 256  # rotary: the backbone's
    rows = {(r["task"], r["metric"]): r for r in art.manifest["metrics"]["lm_eval"]}
    assert {("dihal_pydoc_mc", "acc"), ("dihal_pydoc_ppl", "word_perplexity")} <= set(rows)
    hybrid = dihal.load_hybrid("latest", root=root)
    for name, model in (("hybrid", hybrid), ("original", hybrid.backbone)):
        assert rows[("dihal_pydoc_mc", "acc")][name] == pytest.approx(_by_hand_accuracy(model, hybrid.tokenizer, 256))
    ppl = rows[("dihal_pydoc_ppl", "word_perplexity")]
    assert 1 < ppl["original"] < float("inf") and 1 < ppl["hybrid"] < float("inf") and ppl["hybrid"] != ppl["original"]
    assert (art.path / "lm_eval.csv").read_text().startswith("task,metric,n,hybrid,hybrid_stderr,original")
    again = invoke("evaluate", "--bridge", "latest", *LM_EVAL)
    assert again.exit_code == 0 and "cache hit: evaluate" in again.output
    from dihal.stages import evaluate_harness

    monkeypatch.setattr(evaluate_harness, "_version", lambda: "0.0.0+upgraded")  # its tasks may have changed
    upgraded = invoke("evaluate", "--bridge", "latest", *LM_EVAL)
    assert upgraded.exit_code == 0 and "cache hit" not in upgraded.output, upgraded.output


@pytest.mark.slow
def test_own_tasks_are_indexed_from_their_folder_alone_and_a_harness_task_from_the_whole_index():
    """The harness's whole index reads every YAML it ships (about 7 s a build, twice a command before): tasks
    all of --lm-eval-include's are found in that folder alone; one of the harness's among them, in the whole."""
    from dihal.stages.configs import HarnessConfig
    from dihal.stages.evaluate_harness import task_manager

    own = task_manager(HarnessConfig(tasks=("dihal_pydoc_mc",), include=str(TASKS)))
    assert sorted(own.all_tasks) == ["dihal_pydoc_mc", "dihal_pydoc_ppl"]
    both = task_manager(HarnessConfig(tasks=("dihal_pydoc_mc", "lambada_openai"), include=str(TASKS)))
    assert {"dihal_pydoc_mc", "dihal_pydoc_ppl", "lambada_openai"} <= set(both.all_tasks)
    assert len(both.all_tasks) > 1000


@pytest.mark.slow
def test_lm_eval_bad_requests_are_one_line(store_of, monkeypatch):
    store_of()
    unknown = invoke("evaluate", "--bridge", "latest", "--lm-eval", "dihal_pydoc_nope", "--lm-eval-include", str(TASKS))
    assert unknown.exit_code == 2 and unknown.output.strip().splitlines() == [
        f"error: unknown lm-eval task 'dihal_pydoc_nope': not among the harness's tasks or in {TASKS}"
    ]
    alone = invoke("evaluate", "--samples", "latest", "--lm-eval", "dihal_pydoc_mc")
    assert alone.exit_code == 2 and "give --bridge ID" in alone.output
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # the harness not installed
    missing = invoke("evaluate", "--bridge", "latest", *LM_EVAL)
    assert missing.exit_code == 2 and missing.output.strip().splitlines() == [
        "error: --lm-eval needs lm-evaluation-harness, an optional extra; pip install 'dihal[eval]'"
    ]


def _python_blocks(text: str) -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.slow
def test_every_python_block_of_docs_api_and_the_readme_runs(store_of, root, monkeypatch, capsys):
    """docs/api.md's blocks in order, in one namespace, then README's "From Python" block, against a tiny
    model's store as $DIHAL_ROOT (the docs name tests/data/lm_eval relative to the repository)."""
    store_of()
    monkeypatch.chdir(ROOT)
    api = _python_blocks((ROOT / "docs" / "api.md").read_text())
    readme = (ROOT / "README.md").read_text()
    python_section = readme[readme.index("## From Python") :].split("\n## ", 1)[0]
    blocks = api + _python_blocks(python_section)
    assert len(api) >= 4 and len(blocks) == len(api) + 1
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "CausalLMOutputWithPast" in printed and "True" in printed  # the padded row equals the row alone
    assert set(namespace["scores"]) == {"hybrid", "original"}

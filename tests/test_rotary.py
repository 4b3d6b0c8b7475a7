"""A bridge that runs past its training length (issue 47): the denoiser's rotary positions with a window of
max_len positions and the first one kept. Within max_len it is plain causal RoPE; beyond, every query sees
what a query inside the training length saw; the cached sampler equals the whole one at any length."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dihal
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import ArtifactStore
from dihal.stages.configs import BridgeConfig
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig, rotate
from tests.conftest import invoke

WINDOW = 6


def _net(positions: str = "rotary", seed: int = 0) -> Denoiser:
    torch.manual_seed(seed)
    net = Denoiser(DenoiserConfig(dim=8, width=16, depth=2, heads=2, max_len=WINDOW, positions=positions))
    for p in net.parameters():  # adaLN-Zero starts every block as the identity: make attention count
        torch.nn.init.normal_(p, std=0.3)
    return net.eval()


def test_rotary_scores_depend_on_the_distance_only():
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    score = lambda i, j: float((rotate(q, torch.tensor([i])) * rotate(k, torch.tensor([j]))).sum())
    assert score(3, 1) == pytest.approx(score(103, 101), rel=1e-4) and score(3, 1) != pytest.approx(score(3, 0))


def test_within_the_window_rotary_is_plain_causal_and_past_it_only_the_window_and_the_first_count():
    net = _net()
    x, c, t = torch.randn(1, 20, 8), torch.randn(1, 20, 8), torch.tensor([0.5])
    out = net(x, t, c)
    inside = net(x[:, :WINDOW], t, c[:, :WINDOW])
    torch.testing.assert_close(out[:, :WINDOW], inside)  # a longer input changes nothing before it
    p = 15  # its window is 10..15 and 0; through two layers, 5..15 and 0 (each layer reaches a window further)
    moved = x.clone()
    moved[:, 1:5] += 3.0  # out of reach (and not the first position)
    assert torch.allclose(net(moved, t, c)[:, p], out[:, p], atol=1e-6)
    first = x.clone()
    first[:, 0] += 3.0  # the first position stays visible
    assert not torch.allclose(net(first, t, c)[:, p], out[:, p], atol=1e-4)
    shifted = net(x[:, 4:], t, c[:, 4:], start=4)  # no cache: positions 4.. alone, a window that starts later
    assert shifted.shape == (1, 16, 8)


def test_the_cached_forward_equals_the_whole_one_at_any_length():
    net = _net()
    x, c, t = torch.randn(2, 25, 8), torch.randn(2, 25, 8), torch.tensor([0.3, 0.3])
    whole = net(x, t, c)
    caches, parts = net.new_caches(), []
    for lo, hi in [(0, 3), (3, 4), (4, 11), *[(k, k + 1) for k in range(11, 25)]]:
        parts.append(net(x[:, lo:hi], t, c[:, lo:hi], lo, caches))
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-5)
    assert caches[0]["k"].shape[2] <= WINDOW + 1  # the cache keeps only what later queries can attend


def test_learned_positions_keep_their_ids_and_rotary_hashes_its_option():
    learned = BridgeConfig.from_protocol("cpu-small", layer=1, positions="learned")
    assert "positions" not in learned.hashed()  # every bridge made before keeps its id
    assert BridgeConfig.from_protocol("cpu-small", layer=1).hashed()["positions"] == "rotary"  # the default
    state = _net("learned").state_dict()
    assert "pos.weight" in state and "pos.weight" not in _net("rotary").state_dict()


@pytest.mark.slow  # 6.2 s on 2 cores (the marker's rule: over ~4 s)
def test_a_rotary_bridge_runs_the_hybrid_past_its_training_length(tiny_dirs, root):
    extract = ["extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "40", "--seq-len", "16"]
    assert invoke(*extract, "--layers", "0,2", "--device", "cpu").exit_code == 0
    train = ["train-bridge", "--layer", "2", "--extract", "latest", "--protocol", "sweep-tiny", "--width", "16"]
    train += ["--depth", "1", "--heads", "2", "--batch-size", "4", "--train-steps", "6"]
    res = invoke(*train)  # rotary: the default
    assert res.exit_code == 0, res.output
    store = ArtifactStore(root)
    bridge = store.resolve("latest", "bridge")
    assert bridge.config["positions"] == "rotary"
    hybrid = dihal.load_hybrid(bridge.id, root=root)
    assert hybrid.positions == 256  # the tiny backbone's context, not the extract's 16
    ids = torch.randint(3, 300, (1, 64))
    ids[0, 0] = hybrid.start_id
    full = hybrid(input_ids=ids).logits
    assert torch.isfinite(full).all() and full.shape[1] == 64
    out = hybrid(input_ids=ids[:, :10], use_cache=True)
    steps = [out.logits]
    for k in range(10, 64):
        out = hybrid(input_ids=ids[:, k : k + 1], cache=out.cache)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    made = invoke("generate", "--bridge", bridge.id, "--num-samples", "2", "--max-new-tokens", "60", "--device", "cpu")
    assert made.exit_code == 0, made.output  # 60 new tokens from a bridge trained on 16
    longer = ["extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "20", "--seq-len", "48"]
    assert invoke(*longer, "--layers", "0,2", "--device", "cpu").exit_code == 0
    held = store.resolve("latest", "extract")
    fid = ["evaluate", "--bridge", bridge.id, "--extract", held.id, "--sample-steps", "2", "--device", "cpu"]
    res = invoke(*fid)
    assert res.exit_code == 0, res.output  # 48-token held-out sequences, three times the training length
    import pandas as pd

    art = store.resolve("latest", "evaluate")
    per = pd.read_csv(art.file("fidelity_by_position.csv"))
    whole = pd.read_csv(art.file("fidelity.csv")).iloc[0]
    assert per["position"].max() == 47 and per["n"].min() > 0
    scored = per.dropna(subset=["nll_hybrid"])  # every position but the last predicts a token
    ratio = np.exp((scored["nll_hybrid"] * scored["n"]).sum() / scored["n"].sum()) / np.exp(
        (scored["nll_original"] * scored["n"]).sum() / scored["n"].sum()
    )
    assert ratio == pytest.approx(whole["ppl_ratio"], rel=1e-6)  # the bins' NLLs add up to the whole
    learned = invoke(
        *[bridge.manifest["parents"]["extract"] if a == "latest" else a for a in train], "--positions", "learned"
    )
    assert learned.exit_code == 0, learned.output
    fid[2] = store.resolve("latest", "bridge").id
    assert "a --positions rotary bridge runs past its --seq-len" in invoke(*fid).output
    short = dihal.load_hybrid(fid[2], root=root)
    assert short.positions == 16
    with pytest.raises(DihalError, match="17 tokens, but the bridge covers 16 positions"):
        short(input_ids=torch.ones(1, 17, dtype=torch.long))
    refused = invoke(
        "generate", "--bridge", "latest", "--num-samples", "1", "--max-new-tokens", "60", "--device", "cpu"
    )
    assert refused.exit_code == 2 and "a --positions rotary bridge runs past it" in refused.output


def _loglikelihood(hybrid, tokens: list[int], scored: int, max_length: int) -> float:
    """log p of the last `scored` tokens given the rest, as the harness cuts a request: the last max_length + 1
    tokens, the last one only predicted (HFLM._loglikelihood_tokens' rule, written here on its own)."""
    window = tokens[-(max_length + 1) :]
    with torch.no_grad():
        logits = hybrid(input_ids=torch.tensor([window[:-1]])).logits[0].double()
    logp = torch.log_softmax(logits, -1)[-scored:]
    return float(logp.gather(1, torch.tensor(window[-scored:]).unsqueeze(1)).sum())


def _rolling(hybrid, tokens: list[int], prefix: int, max_length: int) -> float:
    """A document's log p in the harness's rolling windows (context 1): the first window predicts its first
    max_length tokens after the prefix token, each next one the following max_length tokens with every token
    before them, up to max_length, as context."""
    total, done = _loglikelihood(hybrid, [prefix, *tokens[:max_length]], min(max_length, len(tokens)), max_length), 0
    done = min(max_length, len(tokens))
    while done < len(tokens):
        end = min(done + max_length, len(tokens))
        total += _loglikelihood(hybrid, tokens[:end], end - done, max_length)
        done = end
    return total


@pytest.mark.slow
def test_lm_eval_past_the_training_length_equals_a_loop_over_the_hybrids_log_probabilities(tiny_dirs, root):
    """The local tasks' contexts run to 46+ tokens, past the bridge's 16; a rotary bridge scores them whole (the
    harness's max_length is the backbone's 256). Each request's log-likelihood the harness logged equals one
    computed here, request by request, from the hybrid's own logits and the harness's truncation rule, to 1e-4;
    so does each document's rolling one. (Before: max_length == 256 and 0 <= acc <= 1.)"""
    positions = "rotary"
    import json

    from transformers import AutoTokenizer

    from tests.test_api import LM_EVAL

    extract = ["extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "40", "--seq-len", "16"]
    assert invoke(*extract, "--layers", "0,2", "--device", "cpu").exit_code == 0
    train = ["train-bridge", "--layer", "2", "--extract", "latest", "--protocol", "sweep-tiny", "--width", "16"]
    train += ["--depth", "1", "--heads", "2", "--batch-size", "4", "--train-steps", "4", "--positions", positions]
    assert invoke(*train).exit_code == 0
    res = invoke("evaluate", "--bridge", "latest", *LM_EVAL, "--lm-eval-limit", "4", "--lm-eval-log-samples")
    assert res.exit_code == 0, res.output
    art = ArtifactStore(root).resolve("latest", "evaluate")
    max_length = art.manifest["metrics"]["max_length"]
    assert max_length == 256
    hybrid = dihal.load_hybrid("latest", root=root)
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    samples = lambda task: [
        json.loads(line) for line in art.file(f"samples/hybrid/{task}.jsonl").read_text().split("\n") if line
    ]
    longest = 0
    for row in samples("dihal_pydoc_mc"):
        for (context, continuation), (logged, _) in zip(row["arguments"], [r[0] for r in row["resps"]]):
            spaces = len(context) - len(context.rstrip())  # the harness moves them to the continuation
            context, continuation = context[: len(context) - spaces], context[len(context) - spaces :] + continuation
            whole, head = tok.encode(context + continuation), tok.encode(context)
            longest = max(longest, len(head))
            mine = _loglikelihood(hybrid, whole, len(whole) - len(head), max_length)
            assert mine == pytest.approx(float(logged), abs=1e-4), (context[-30:], continuation)
    assert longest > 16  # contexts past the bridge's training length
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    for row in samples("dihal_pydoc_ppl"):
        (text,) = row["arguments"][0]
        logged = float(row["resps"][0][0])
        assert _rolling(hybrid, tok.encode(text), prefix, max_length) == pytest.approx(logged, abs=1e-4)


@pytest.mark.slow
def test_lm_eval_on_a_learned_bridge_shorter_than_a_continuation_is_one_line(tiny_dirs, root):
    """A learned bridge of 16 positions gives the harness max_length 16; a continuation of the local tasks runs
    longer, which HFLM asserts against: one error line naming the fix, the artifact failed (was a bare
    AssertionError from inside the harness)."""
    from tests.test_api import LM_EVAL
    from tests.test_hardening import _one_error_line

    extract = ["extract", "--model", str(tiny_dirs["llama"]), "--max-sequences", "40", "--seq-len", "16"]
    assert invoke(*extract, "--layers", "0,2", "--device", "cpu").exit_code == 0
    train = ["train-bridge", "--layer", "2", "--extract", "latest", "--protocol", "sweep-tiny", "--width", "16"]
    train += ["--depth", "1", "--heads", "2", "--batch-size", "4", "--train-steps", "2", "--positions", "learned"]
    assert invoke(*train).exit_code == 0
    res = invoke("evaluate", "--bridge", "latest", *LM_EVAL, "--lm-eval-limit", "4")
    _one_error_line(res, "longer than the hybrid's 16 positions", during_work=True)
    assert "use a rotary bridge" in res.output
    assert [a.status for a in ArtifactStore(root).all("evaluate")] == ["failed"]

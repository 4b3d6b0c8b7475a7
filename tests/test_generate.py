"""Hybrid generation and generation metrics."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from dihal.stages import generate as gen_stage
from dihal.stages.lm.models import wrap_model
from dihal.stages.text import text_metrics as tm
from tests.conftest import build_tiny, invoke


class OracleBridge:
    """Returns the exact layer-l states: blocks 1..l of the backbone run on the given h_0."""

    def __init__(self, model, layer):
        self.model, self.layer, self.start = model, layer, 1

    def noise(self, batch, length, generator):
        return torch.zeros(batch, length - self.start, 1)

    def sample(self, h0, steps, noise):
        from dihal.stages.lm.capture import capture_layers

        with torch.no_grad(), capture_layers(self.model, [self.layer]) as captured:
            try:
                self.model.model(inputs_embeds=h0, use_cache=False)
            except Exception:  # noqa: BLE001 - the capture stops the forward early
                pass
            return captured[self.layer]

    def cached_sampler(self, steps, batch):
        oracle = self

        class History:
            h0 = None

            def extend(self, h0_new, noise_new):
                self.h0 = h0_new if self.h0 is None else torch.cat([self.h0, h0_new], 1)
                return oracle.sample(self.h0, steps, None)[:, -h0_new.shape[1] :]

        return History()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("cache", [True, False])
def test_oracle_bridge_greedy_hybrid_equals_original(kind, cache):
    model, tok = build_tiny(kind, layers=4)
    loaded = wrap_model(model, tok, {"name": kind})
    cfg = gen_stage.GenerateConfig(prompts=("The",), num_samples=2, max_new_tokens=20, temperature=0, cache=cache)
    prefix = torch.tensor([gen_stage.prompt_ids(tok, "The module")] * 2)
    original = gen_stage.generate_original(loaded, prefix, cfg, torch.Generator().manual_seed(0))
    suffix = gen_stage.suffix_model(model, 2)
    hybrid = gen_stage.generate_hybrid(
        loaded, OracleBridge(model, 2), suffix, prefix, cfg, torch.Generator().manual_seed(0)
    )
    assert torch.equal(hybrid, original)


@pytest.fixture(scope="module")
def tiny_trained_bridge(tiny_dirs, tmp_path_factory):
    """A bridge trained briefly on a tiny Llama extract (its quality is irrelevant here)."""
    from dihal.artifacts.store import ArtifactStore
    from dihal.stages import extract as estage
    from dihal.stages import train_bridge as bstage
    from dihal.stages.text.data import DataConfig

    store = ArtifactStore(tmp_path_factory.mktemp("gen-runs"))
    ex = estage.run(
        estage.ExtractConfig(
            model=str(tiny_dirs["llama"]), layers="0,2", data=DataConfig(max_sequences=24, seq_len=16)
        ),
        store,
    )
    cfg = bstage.BridgeConfig.from_protocol("sweep-tiny", layer=2, steps=5, width=32, depth=2, batch_size=8)
    art = bstage.run(cfg, ex, store)
    return store, art


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["The", ""])  # "": the start token alone, as in unprompted generation
def test_cached_and_uncached_generation_agree_and_are_deterministic(tiny_trained_bridge, tiny_dirs, prompt):
    from dihal.stages.lm.models import load_model
    from dihal.stages.parts.bridge import Bridge

    store, art = tiny_trained_bridge
    loaded = load_model(str(tiny_dirs["llama"]), "cpu", "float32")
    bridge = Bridge.load(art)
    suffix = gen_stage.suffix_model(loaded.model, 2)
    prefix = torch.tensor([gen_stage.prompt_ids(loaded.tokenizer, prompt)] * 3)
    outs = {}
    for cache in (True, False):
        cfg = gen_stage.GenerateConfig(max_new_tokens=12, sample_steps=4, cache=cache, top_k=50, top_p=0.9)
        outs[cache] = gen_stage.generate_hybrid(loaded, bridge, suffix, prefix, cfg, torch.Generator().manual_seed(5))
    assert torch.equal(outs[True], outs[False])
    cfg = gen_stage.GenerateConfig(max_new_tokens=12, sample_steps=4)
    again = [
        gen_stage.generate_hybrid(loaded, bridge, suffix, prefix, cfg, torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert torch.equal(again[0], again[1])


def test_generate_cli_then_evaluate_samples(tiny_trained_bridge, monkeypatch):
    store, art = tiny_trained_bridge
    monkeypatch.setenv("DIHAL_ROOT", str(store.root))
    res = invoke(
        "generate",
        "--bridge",
        art.id,
        "--prompt",
        "The",
        "--num-samples",
        "3",
        "--max-new-tokens",
        "8",
        "--baseline",
        "original",
        "--seed",
        "3",
        "--device",
        "cpu",
    )
    assert res.exit_code == 0, res.output
    gen_art = store.resolve("latest", "generate")
    rows = [json.loads(l) for l in gen_art.file("samples.jsonl").read_text().splitlines()]
    base = [json.loads(l) for l in gen_art.file("samples_original.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and len(base) == 3 and all(r["model"] == "hybrid" for r in rows)
    assert all(len(r["token_ids"]) <= 8 and r["prompt"] == "The" for r in rows)
    again = invoke(
        "generate",
        "--bridge",
        art.id,
        "--prompt",
        "The",
        "--num-samples",
        "3",
        "--max-new-tokens",
        "8",
        "--baseline",
        "original",
        "--seed",
        "3",
        "--device",
        "cpu",
        "--force",
        "--batch-size",
        "8",  # what --batch-size auto (the first run's) is on the CPU: the same computation, the same id
    )
    assert again.exit_code == 0
    assert store.resolve("latest", "generate").id == gen_art.id
    rows2 = [json.loads(l) for l in store.resolve("latest", "generate").file("samples.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in rows2] == [r["token_ids"] for r in rows]
    ev = invoke("evaluate", "--samples", gen_art.id, "--json", "--device", "cpu")
    assert ev.exit_code == 0, ev.output
    results = json.loads(ev.output)["results"]
    assert [r["model"] for r in results] == ["hybrid", "original"]
    texts = [r["text"] for r in rows]
    assert results[0]["diversity"] == pytest.approx(tm.diversity(texts))


def test_gen_ppl_equals_independent_computation(tiny_dirs):
    from dihal.stages.evaluate import gen_ppl, sample_nlls
    from dihal.stages.lm.models import load_model

    loaded = load_model(str(tiny_dirs["llama"]), "cpu", "float32")
    tok, model = loaded.tokenizer, loaded.model
    prompts, texts = ["The", ""], [" module provides functions.", "Return the value of x."]
    ppl = gen_ppl(sample_nlls(loaded, prompts, texts))
    total_nll, total_n, per_sample = 0.0, 0, []
    for prompt, text in zip(prompts, texts):
        head = [tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]
        full = [tok.bos_token_id] + tok(prompt + text, add_special_tokens=False)["input_ids"]
        nll = 0.0
        with torch.no_grad():
            for i in range(len(head), len(full)):  # one forward per token, no batching tricks
                logits = model(torch.tensor([full[:i]])).logits[0, -1]
                nll -= torch.log_softmax(logits.double(), -1)[full[i]].item()
        total_nll, total_n = total_nll + nll, total_n + len(full) - len(head)
        per_sample.append(math.exp(nll / (len(full) - len(head))))
    assert ppl["gen_ppl_token"] == pytest.approx(math.exp(total_nll / total_n), rel=1e-4)
    assert ppl["gen_ppl_mean"] == pytest.approx(sum(per_sample) / 2, rel=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3"])
def test_batched_scoring_equals_one_text_at_a_time(tiny_dirs, kind, monkeypatch):
    """Right padding never reaches a text's own positions: NLLs and MAUVE features of a padded batch
    of very different lengths equal those of one forward per text (qwen3: a tokenizer without BOS)."""
    from dihal.stages.evaluate import last_token_features, sample_nlls
    from dihal.stages.lm.models import load_model

    loaded = load_model(str(tiny_dirs[kind]), "cpu", "float32")
    prompts = ["", "The", "", "Return", ""]
    texts = [" x", " module provides functions for working with paths and files.", "a b", " the value.", ""]
    single = sample_nlls(loaded, prompts, texts, batch_size=1)
    monkeypatch.setattr("dihal.stages.evaluate.HEAD_ROWS", 5)  # a batch's positions cross the head in pieces
    batched = sample_nlls(loaded, prompts, texts, batch_size=4)
    assert [n for _, n in batched] == [n for _, n in single] and batched[-1] == (0.0, 0)
    assert all(n > 0 for _, n in batched[:-1])
    np.testing.assert_allclose([s for s, _ in batched], [s for s, _ in single], rtol=1e-5, atol=1e-5)
    features = last_token_features(loaded, texts[:4], batch_size=3)
    assert features.shape == (4, loaded.model.config.hidden_size)
    np.testing.assert_allclose(features, last_token_features(loaded, texts[:4], batch_size=1), rtol=1e-5, atol=1e-5)


def test_diversity_and_distinct_on_hand_made_texts():
    texts = ["a b c a b c", "A B D"]
    # words: [a b c a b c], [a b d]; bigrams: ab bc ca ab bc | ab bd -> 7 total, unique {ab, bc, ca, bd} = 4
    assert tm.distinct_n(texts, 2) == pytest.approx(4 / 7)
    # trigrams: abc bca cab abc | abd -> 5 total, 4 unique; 4-grams: abca bcab cabc -> 3 of 3
    assert tm.distinct_n(texts, 3) == pytest.approx(4 / 5)
    assert tm.distinct_n(texts, 4) == pytest.approx(1.0)
    assert tm.diversity(texts) == pytest.approx(4 / 7 * 4 / 5 * 1.0)
    assert tm.distinct_n(texts, 1) == pytest.approx(4 / 9)
    # unigram counts a:3 b:3 c:2 d:1 over 9
    expected = -sum(p * math.log(p) for p in (3 / 9, 3 / 9, 2 / 9, 1 / 9))
    assert tm.unigram_entropy(texts) == pytest.approx(expected)
    assert tm.diversity(["same words here again"] * 5) < tm.diversity(["one two three four", "five six seven eight"])


def test_generate_bad_input(tiny_trained_bridge, tmp_path, monkeypatch):
    store, art = tiny_trained_bridge
    monkeypatch.setenv("DIHAL_ROOT", str(store.root))
    res = invoke("generate", "--bridge", "nonexistent0")
    assert res.exit_code == 2 and "no bridge artifact 'nonexistent0'" in res.output
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n\n")
    res = invoke("generate", "--bridge", art.id, "--prompts-file", str(empty))
    assert res.exit_code == 2 and "is empty" in res.output
    for bad in ("0", "1.5"):
        res = invoke("generate", "--bridge", art.id, "--top-p", bad)
        assert res.exit_code == 2 and "--top-p must be in (0, 1]" in res.output
        assert len(res.output.strip().splitlines()) == 1
    for bad, needle in (("0", "--batch-size must be at least 1 (or auto)"), ("many", "cannot read --batch-size")):
        res = invoke("generate", "--bridge", art.id, "--batch-size", bad)
        assert res.exit_code == 2 and needle in res.output and len(res.output.strip().splitlines()) == 1


def test_heads_of_fidelity_and_gen_ppl_compute_in_float32_whatever_the_dtype(tiny_dirs):
    """A bfloat16 model's logits for evaluation are its float32 head on the hidden states: equal to a
    float64 reference to float32 rounding, unlike the bfloat16 head's own."""
    from transformers import AutoModelForCausalLM

    from dihal.stages.lm.hybrid import lm_logits

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["gemma3"], dtype=torch.bfloat16).eval()
    hidden = torch.randn(5, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    cap = model.config.final_logit_softcapping
    reference = hidden.double() @ model.lm_head.weight.double().T
    reference = torch.tanh(reference / cap) * cap if cap else reference
    got = lm_logits(model, hidden)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
    own = model.lm_head(hidden).double()
    own = torch.tanh(own / cap) * cap if cap else own
    assert (own - reference).abs().max() > 10 * (got.double() - reference).abs().max()


def test_evaluate_batch_size_is_honoured_for_samples(tiny_dirs, root, monkeypatch):
    from dihal.stages import evaluate

    args = [
        "generate",
        "--baseline",
        "original-only",
        "--model",
        str(tiny_dirs["llama"]),
        "--num-samples",
        "7",
        "--max-new-tokens",
        "5",
        "--device",
        "cpu",
    ]
    assert invoke(*args).exit_code == 0
    sizes, real = [], evaluate._forward_padded
    monkeypatch.setattr(evaluate, "_forward_padded", lambda loaded, rows: sizes.append(len(rows)) or real(loaded, rows))
    res = invoke("evaluate", "--samples", "latest", "--batch-size", "3", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert sizes == [3, 3, 1]


def test_dtype_auto_picks_bfloat16_only_where_the_gpu_has_it(monkeypatch):
    from dihal.stages.lm import models

    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: True)
    for capability, expected in (((7, 0), torch.float32), ((7, 5), torch.float32), ((8, 0), torch.bfloat16)):
        monkeypatch.setattr(models.torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert models.resolve_dtype("auto", "cuda") == expected  # V100 7.0 and T4 7.5 only emulate bfloat16
    assert models.resolve_dtype("auto", "cpu") == torch.float32


def test_a_gpu_generation_draws_on_its_device_and_its_id_says_so():
    """On a GPU the bridge's noise and every token's draw come from the device's own generator, so nothing of a
    token goes through the host: another stream than the CPU's for the same seed, so such a generation's id
    differs from one made before by more than the device. On the CPU the key and the stream are as before."""
    from dihal.stages.configs import GenerateConfig

    assert "draws" not in gen_stage.generate_key(GenerateConfig(device="cpu"))
    assert gen_stage.generate_key(GenerateConfig(device="cuda"))["draws"] == "device"
    assert [gen_stage.draw_device(d) for d in ("cpu", "cuda", "cuda:1")] == ["cpu", "cuda", "cuda:1"]
    logits = torch.randn(3, 50)
    ours = torch.Generator(gen_stage.draw_device("cpu")).manual_seed(7)
    assert torch.equal(
        gen_stage.decoding.sample(logits, 1.0, gen=ours),
        torch.multinomial(logits.double().softmax(-1), 1, generator=torch.Generator().manual_seed(7))[:, 0],
    )


def test_the_memory_rule_counts_the_caches_a_generation_holds_and_sizes_the_batch(tiny_trained_bridge, tiny_dirs):
    """--batch-size auto on a GPU: the bytes the rule counts for the KV cache of the blocks that run and the
    denoiser's caches are those the hybrid's and the original's generation hold at their end (read off the
    caches themselves), its weights are the model's matrices, and the batch is the most that fit MEMORY_SHARE
    of the card; a card too small for one sample is one line with the sizes."""
    from dihal.stages.configs import GenerateConfig
    from dihal.stages.lm.models import load_model
    from dihal.stages.parts.bridge import Bridge

    store, art = tiny_trained_bridge
    loaded = load_model(str(tiny_dirs["llama"]), "cpu", "float32")
    bridge, layer = Bridge.load(art), 2
    suffix = gen_stage.suffix_model(loaded.model, layer)
    prefix = torch.tensor([gen_stage.prompt_ids(loaded.tokenizer, "The")] * 3)
    cfg = GenerateConfig(max_new_tokens=8, sample_steps=4)
    held = {"kv": [], "samplers": []}

    class Recorded(gen_stage.DynamicCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            held["kv"].append(self)

    real_sampler = bridge.cached_sampler
    bridge.cached_sampler = lambda *a: held["samplers"].append(real_sampler(*a)) or held["samplers"][-1]
    gen_stage.DynamicCache, before = Recorded, gen_stage.DynamicCache
    try:
        gen_stage.generate_hybrid(loaded, bridge, suffix, prefix, cfg, torch.Generator().manual_seed(0))
        gen_stage.generate_original(loaded, prefix, cfg, torch.Generator().manual_seed(0))
    finally:
        gen_stage.DynamicCache = before
    kv_bytes = [sum(x.keys.nbytes + x.values.nbytes for x in c.layers if x.keys is not None) for c in held["kv"]]
    bridge_bytes = sum(c["k"].nbytes + c["v"].nbytes for step in held["samplers"][0].caches for c in step)
    shape = gen_stage.shape_of(loaded.model.config)
    meta = {**json.loads(art.file("bridge.json").read_text()), "steps": 4}
    hybrid = gen_stage.sample_bytes(shape, layer, meta, prefix.shape[1], 8, 4)
    original = gen_stage.sample_bytes(shape, 0, None, prefix.shape[1], 8, 4)
    assert kv_bytes == [3 * hybrid["kv"], 3 * original["kv"]] and bridge_bytes == 3 * hybrid["bridge_cache"]
    matrices = sum(p.numel() for p in loaded.model.parameters() if p.dim() == 2)
    assert gen_stage.weight_bytes(shape, 4) == 4 * matrices

    # before any tokenizer loads, the rule counts the prompt as a token a byte, after the start token: 1 + 3
    assert prefix.shape[1] <= 4
    at_most = [sum(gen_stage.sample_bytes(shape, l, m, 4, 8, 4).values()) for l, m in ((layer, meta), (0, None))]
    need, weights = max(at_most), gen_stage.weight_bytes(shape, 4)
    card = lambda batch: int((weights + (batch + 0.5) * need) / gen_stage.MEMORY_SHARE)
    gpu = GenerateConfig(max_new_tokens=8, sample_steps=4, num_samples=64, device="cuda", prompts=("The",))
    assert gen_stage.auto_batch(replace(gpu, baseline="original"), art, total=card(5)) == 5
    assert gen_stage.auto_batch(replace(gpu, baseline="original"), art, total=card(500)) == 64  # --num-samples
    assert gen_stage.auto_batch(replace(gpu, device="cpu"), art, total=card(5)) == gen_stage.CPU_BATCH
    with pytest.raises(gen_stage.DihalError, match=r"one sample of 8 new tokens needs .* GiB beside the weights'"):
        gen_stage.auto_batch(gpu, art, total=int(weights / gen_stage.MEMORY_SHARE))

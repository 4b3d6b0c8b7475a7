"""The hybrid as a causal LM in full (issue 47): a KV cache that transformers' own generate and pipeline
run on, every generation argument honoured or refused in one line. One test per row of the argument table
(docs/api.md); the tiny bridges of tests/test_api.py."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, GenerationMixin, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import dihal
from dihal.artifacts.errors import DihalError
from tests.test_api import api_stores, store_of  # noqa: F401 - the fixtures

KINDS = ["llama", "qwen3"]  # a BOS model and one without (Qwen3's shape)


@pytest.fixture()
def hybrid(store_of):  # noqa: F811
    return dihal.load_hybrid("latest", root=store_of("llama").root)


def _prompt(hybrid, words: str = "A list is a sequence") -> torch.Tensor:
    ids = hybrid.tokenizer(words, add_special_tokens=False)["input_ids"]
    return torch.tensor([[hybrid.start_id, *ids]])


def _greedy(hybrid, prompt, new: int) -> list[int]:
    """Greedy continuation by full teacher-forced forwards, one token at a time: the reference."""
    ids = prompt
    for _ in range(new):
        ids = torch.cat([ids, hybrid(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.shape[1] :].tolist()


# -- the cache ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_stepwise_forward_with_the_cache_gives_the_full_forwards_logits(kind, store_of):  # noqa: F811
    hybrid = dihal.load_hybrid("latest", root=store_of(kind).root)
    ids = torch.cat([_prompt(hybrid), torch.tensor([[40, 41, 42, 43, 44, 45]])], dim=1)
    full = hybrid(input_ids=ids).logits
    out = hybrid(input_ids=ids[:, :4], use_cache=True)
    steps = [out.logits]
    for k in range(4, ids.shape[1]):
        out = hybrid(input_ids=ids[:, k : k + 1], cache=out.cache, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert type(out.cache).__mro__[1].__name__ == "DynamicCache" and out.cache.get_seq_length() == ids.shape[1]


def test_a_left_padded_batch_through_the_cache_gives_each_rows_own_logits(hybrid):
    long, short = _prompt(hybrid), _prompt(hybrid, "A set")
    pad = long.shape[1] - short.shape[1]
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    out = hybrid(input_ids=batch, attention_mask=mask, use_cache=True)
    nxt = torch.tensor([[50], [51]])
    grown = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    step = hybrid(input_ids=nxt, attention_mask=grown, cache=out.cache)
    alone = hybrid(input_ids=torch.cat([short, nxt[:1]], 1)).logits[0, -1]
    torch.testing.assert_close(step.logits[0, -1], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.logits[1, -1], hybrid(input_ids=torch.cat([long, nxt[1:]], 1)).logits[0, -1])
    with pytest.raises(DihalError, match="padded on the left only"):
        hybrid(input_ids=batch.flip(1), attention_mask=mask.flip(1), use_cache=True)
    with pytest.raises(DihalError, match="continues only a HybridCache"):
        hybrid(input_ids=nxt, cache=__import__("transformers").DynamicCache())


@pytest.mark.slow  # 6.5 s on 2 cores (the marker's rule: over ~4 s)
@pytest.mark.parametrize("kind", KINDS)
def test_transformers_own_generate_writes_the_hybrids_loops_tokens(kind, store_of):  # noqa: F811
    """GenerationMixin.generate itself (the parent's, not the override) against the hybrid's own cached loop
    (stages/generate.py, what `dihal generate` runs) fed the same noise, both greedy."""
    from dihal.stages import generate as gen_stage
    from dihal.stages.configs import GenerateConfig

    hybrid = dihal.load_hybrid("latest", root=store_of(kind).root)
    prompt, new = _prompt(hybrid), 8
    theirs = GenerationMixin.generate(hybrid, prompt, max_new_tokens=new, do_sample=False, eos_token_id=None)
    cfg = GenerateConfig(max_new_tokens=new, temperature=0.0, sample_steps=hybrid.config.steps)
    noise = hybrid.noise_for(prompt.shape[1] + new - hybrid.bridge.start)[None]
    ours = gen_stage.generate_hybrid(hybrid.loaded, hybrid.bridge, hybrid.suffix, prompt, cfg, None, noise)
    reference = _greedy(hybrid, prompt, new)
    assert ours[0].tolist() == reference
    assert theirs[0, prompt.shape[1] :].tolist() == reference


# -- the argument table: honoured ---------------------------------------------------------------------------
def test_a_streamer_receives_the_new_tokens(hybrid):
    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer, prompt = Collect(), _prompt(hybrid)
    out = hybrid.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=None, streamer=streamer)
    assert streamer.ended and streamer.chunks[0] == prompt[0].tolist()  # the prompt first, as transformers does
    streamed = [t for chunk in streamer.chunks[1:] for t in chunk]
    assert streamed == out[0, prompt.shape[1] :].tolist()
    assert hybrid.tokenizer.decode(streamed) == hybrid.tokenizer.decode(out[0, prompt.shape[1] :])


def test_num_return_sequences_gives_that_many_rows_and_sampling_follows_the_seed(hybrid):
    prompt = _prompt(hybrid)
    torch.manual_seed(0)
    three = hybrid.generate(prompt, max_new_tokens=6, do_sample=True, num_return_sequences=3, top_k=50)
    assert three.shape == (3, prompt.shape[1] + 6) and torch.equal(three[:, : prompt.shape[1]], prompt.repeat(3, 1))
    assert len({tuple(r) for r in three[:, prompt.shape[1] :].tolist()}) > 1  # sampled: the rows differ
    torch.manual_seed(0)
    again = hybrid.generate(prompt, max_new_tokens=6, do_sample=True, num_return_sequences=3, top_k=50)
    assert torch.equal(again, three)


def test_a_generation_config_and_max_length_are_obeyed(hybrid):
    prompt = _prompt(hybrid)
    out = hybrid.generate(prompt, generation_config=GenerationConfig(max_new_tokens=2, do_sample=False))
    assert out.shape[1] == prompt.shape[1] + 2
    assert hybrid.generate(prompt, max_length=prompt.shape[1] + 3, do_sample=False, eos_token_id=None).shape[1] == (
        prompt.shape[1] + 3
    )


def test_greedy_top_k_1_and_temperature_agree_with_the_logits(hybrid):
    prompt = _prompt(hybrid)
    greedy = hybrid.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=None)[0, prompt.shape[1] :]
    assert greedy.tolist() == _greedy(hybrid, prompt, 4)
    one = hybrid.generate(prompt, max_new_tokens=4, do_sample=True, top_k=1, eos_token_id=None)[0, prompt.shape[1] :]
    assert torch.equal(one, greedy)  # sampling among the top 1 is greedy
    cold = hybrid.generate(prompt, max_new_tokens=4, do_sample=True, temperature=1e-4, top_p=0.9, eos_token_id=None)
    assert torch.equal(cold[0, prompt.shape[1] :], greedy)  # a temperature near 0 is greedy too


def test_a_stopping_criterion_stops(hybrid):
    class AfterTwo(StoppingCriteria):
        def __init__(self, start):
            self.start = start

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.start >= 2, dtype=torch.bool)

    prompt = _prompt(hybrid)
    criteria = StoppingCriteriaList([AfterTwo(prompt.shape[1])])
    out = hybrid.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, stopping_criteria=criteria)
    assert out.shape[1] == prompt.shape[1] + 2


def test_eos_as_a_list_min_new_tokens_and_the_pad_id(hybrid):
    prompt = _prompt(hybrid)
    greedy = _greedy(hybrid, prompt, 6)
    stop = greedy[2]
    assert stop not in greedy[:2]
    out = hybrid.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=[999_999 % 300, stop], pad_token_id=7)
    new = out[0, prompt.shape[1] :].tolist()
    assert new[: new.index(stop) + 1] == greedy[:3]  # it stops at the listed id ...
    two = hybrid.generate(
        torch.cat([prompt, prompt]), max_new_tokens=6, do_sample=False, eos_token_id=[stop], pad_token_id=7
    )
    assert two[0, prompt.shape[1] + 3 :].tolist() == [7] * (two.shape[1] - prompt.shape[1] - 3)  # ... then pads
    late = hybrid.generate(prompt, max_new_tokens=6, min_new_tokens=4, do_sample=False, eos_token_id=[stop])
    assert stop not in late[0, prompt.shape[1] : prompt.shape[1] + 4].tolist()  # not before min_new_tokens


def test_return_dict_in_generate_carries_the_sequences_and_scores(hybrid):
    prompt = _prompt(hybrid)
    out = hybrid.generate(
        prompt, max_new_tokens=3, do_sample=False, eos_token_id=None, return_dict_in_generate=True, output_scores=True
    )
    assert out.sequences.shape == (1, prompt.shape[1] + 3) and len(out.scores) == 3
    assert out.sequences[0, prompt.shape[1]].item() == int(out.scores[0][0].argmax())


def test_pipeline_text_generation_writes_the_greedy_text_and_n_rows(hybrid):
    """The pipeline's text is the prompt and the hybrid's own greedy tokens, decoded (before: the test passed
    with nothing generated)."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=hybrid, tokenizer=hybrid.tokenizer)
    prompt = hybrid.tokenizer("A list is", return_tensors="pt")["input_ids"]
    want = hybrid.tokenizer.decode(_greedy(hybrid, prompt, 5))
    assert want.strip()
    (row,) = pipe("A list is", max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert row["generated_text"] == "A list is" + want
    rows = pipe("A list is", max_new_tokens=5, do_sample=True, num_return_sequences=2, eos_token_id=None)
    assert len(rows) == 2 and all(len(r["generated_text"]) > len("A list is") for r in rows)
    assert all(r["generated_text"].startswith("A list is") for r in rows)


def test_a_text_streamer_prints_the_text_generate_returns(hybrid, capsys):
    from transformers import TextStreamer

    prompt = _prompt(hybrid)
    streamer = TextStreamer(hybrid.tokenizer, skip_prompt=True)
    out = hybrid.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, streamer=streamer)
    new = out[0, prompt.shape[1] :].tolist()
    assert new == _greedy(hybrid, prompt, 6)
    printed = capsys.readouterr().out
    assert printed == hybrid.tokenizer.decode(new) + "\n" and printed.strip()


def test_a_stopping_criterion_on_text_stops_each_row_of_a_batch_at_its_own_step(hybrid):
    """A criterion that reads each row's decoded text: a row whose text is seen is finished, and the batch ends
    when its last row is, at that row's own step. Each row's tokens are its own greedy ones (left padding and the
    cache keep the rows apart); transformers pads a finished row only for an EOS criterion, so the early row's
    tokens run on, still its own greedy continuation."""
    long, short = _prompt(hybrid), _prompt(hybrid, "A set")
    pad = long.shape[1] - short.shape[1]
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    greedy = [_greedy(hybrid, short, 8), _greedy(hybrid, long, 8)]
    stops = [2, 5]  # after these many new tokens, by their text
    texts = [hybrid.tokenizer.decode(g[:n]) for g, n in zip(greedy, stops)]

    class TextSeen(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            new = input_ids[:, batch.shape[1] :]
            return torch.tensor([hybrid.tokenizer.decode(row).endswith(text) for row, text in zip(new, texts)])

    out = hybrid.generate(
        batch,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=7,
        stopping_criteria=StoppingCriteriaList([TextSeen()]),
    )
    new = out[:, batch.shape[1] :].tolist()
    assert out.shape[1] == batch.shape[1] + stops[1]  # the batch ends when its last row stops
    assert new[1] == greedy[1][: stops[1]]
    assert new[0] == greedy[0][: stops[1]]
    assert hybrid.tokenizer.decode(new[0]).startswith(texts[0]) and hybrid.tokenizer.decode(new[1]).endswith(texts[1])


# -- the argument table: refused -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"num_beams": 2}, "num_beams=2: the hybrid does not do beam search"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha=0.6: the hybrid does not do contrastive search"),
        ({"prompt_lookup_num_tokens": 3}, "prompt-lookup decoding"),
        ({"output_attentions": True, "return_dict_in_generate": True}, "attentions out"),
        ({"guidance_scale": 1.5}, "classifier-free guidance"),
        ({"cache_implementation": "static"}, "static and quantized caches"),
        ({"generation_config": GenerationConfig(num_beams=3)}, "num_beams=3"),
        ({"frobnicate": 1}, "'frobnicate', which neither transformers' generate nor the hybrid takes"),
    ],
)
def test_what_the_hybrid_cannot_do_is_refused_naming_the_argument(hybrid, kwargs, needle):
    with pytest.raises(DihalError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        hybrid.generate(_prompt(hybrid), max_new_tokens=2, **kwargs)


def test_the_prompts_loop_refuses_what_it_does_not_take(hybrid):
    with pytest.raises(DihalError, match="'streamer', which the prompts' loop does not take"):
        hybrid.generate("The class", max_new_tokens=2, streamer=object())


def test_an_euler_steps_time_and_condition_terms_computed_once_give_the_same_bits():
    """Issue 65: the cached sampler computes each Euler step's time terms once per generation and each position's
    condition terms once for its 8 steps, instead of in every denoiser call; the output is the same to the bit."""
    from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig

    torch.manual_seed(0)
    net = Denoiser(DenoiserConfig(dim=6, width=16, depth=2, heads=2, max_len=8, positions="rotary")).eval()
    for p in net.parameters():  # adaLN-Zero starts at zero: give every term a say
        torch.nn.init.normal_(p, std=0.3)
    x, c, t = torch.randn(3, 2, 6), torch.randn(3, 2, 6), torch.full((3,), 0.625)
    plain = net(x, t, c, start=5)
    cached = net(x, t, c, start=5, times=net.time_terms(t), condition=net.condition_terms(c))
    assert torch.equal(plain, cached)
    assert not torch.equal(plain, net(x, t, c, start=5, times=net.time_terms(t * 0.5)))  # the terms are used


def test_bridge_noise_zero_is_the_flows_mean_path_and_one_keeps_every_id(hybrid):
    """--bridge-noise s scales the bridge's noise (issue 66): at 0 the hybrid's states, and so its greedy
    tokens, no longer depend on the noise's seed, and equal the flow sampled from a zero start by hand; at 1 a
    generation's id is the one it had before the option existed."""
    from dihal.stages import generate as gen_stage
    from dihal.stages.configs import GenerateConfig
    from dihal.stages.diffusion import flow

    prompt, new = _prompt(hybrid), 6
    cfg = GenerateConfig(max_new_tokens=new, temperature=0.0, sample_steps=3, bridge_noise=0.0)
    runs = [
        gen_stage.generate_hybrid(
            hybrid.loaded, hybrid.bridge, hybrid.suffix, prompt, cfg, torch.Generator().manual_seed(s)
        )
        for s in (0, 1)
    ]
    assert runs[0].tolist() == runs[1].tolist()
    # by hand: the states of prompt + tokens from a zero start, the upper blocks' greedy token at the end
    ids = torch.cat([prompt, runs[0][:, :-1]], dim=1)
    h0 = gen_stage._layer0(hybrid.backbone, ids)
    c = hybrid.bridge.norm.c(h0[:, hybrid.bridge.start :])
    y = flow.sample(lambda x, t, i: hybrid.bridge.net(x, t, c), torch.zeros_like(c), 3, hybrid.bridge.prediction)
    states = hybrid.bridge._assemble(y, 1)
    logits = hybrid.suffix(inputs_embeds=states).logits
    assert logits[0, prompt.shape[1] - 1 :].argmax(-1).tolist() == runs[0][0].tolist()
    one = GenerateConfig(bridge_noise=1.0).hashed()
    assert "bridge_noise" not in one and GenerateConfig(bridge_noise=0.5).hashed()["bridge_noise"] == 0.5
    with pytest.raises(DihalError, match="--mode parallel and --baseline original-only take none"):
        GenerateConfig(mode="parallel", bridge_noise=0.5)

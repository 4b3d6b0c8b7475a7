"""The hybrid reuses the backbone's own upper blocks: exact states in -> the original logits out."""

from __future__ import annotations

import pytest
import torch

from stages.lm.hybrid import original_forward, suffix_logits, suffix_model
from tests.conftest import build_tiny


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3"])
def test_oracle_states_reproduce_original_logits_at_every_layer(kind):
    model, _ = build_tiny(kind, layers=4)
    ids = torch.randint(3, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 1
    L = len(model.model.layers)
    logits, states = original_forward(model, ids, list(range(L + 1)))
    for layer in range(1, L + 1):
        with torch.no_grad():
            hybrid = suffix_logits(suffix_model(model, layer), states[layer])
        torch.testing.assert_close(hybrid, logits, atol=1e-5, rtol=1e-5, msg=f"layer {layer}")
    # the original model is untouched by building suffixes
    again, _ = original_forward(model, ids, [0])
    torch.testing.assert_close(again, logits)


def test_suffix_shares_parameters_and_kv_cache_matches_full_pass():
    from transformers import DynamicCache

    model, _ = build_tiny("gemma3", layers=4)
    ids = torch.randint(3, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    _, states = original_forward(model, ids, [2])
    suffix = suffix_model(model, 2)
    assert suffix.model.layers[0].mlp is model.model.layers[2].mlp
    assert suffix.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    with torch.no_grad():
        full = suffix(inputs_embeds=states[2], use_cache=False).logits
        cache = DynamicCache(config=suffix.config)
        first = suffix(inputs_embeds=states[2][:, :12], cache=cache, use_cache=True).logits
        rest = [
            suffix(inputs_embeds=states[2][:, p : p + 1], cache=cache, use_cache=True).logits for p in range(12, 20)
        ]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, atol=1e-5, rtol=1e-5)

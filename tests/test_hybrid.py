"""The hybrid reuses the backbone's own upper blocks: exact states in -> the original logits out."""

from __future__ import annotations

import pytest
import torch

from dihal.stages.lm.hybrid import lm_logits, original_forward, suffix_logits, suffix_model
from tests.conftest import build_tiny


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3"])
def test_oracle_states_reproduce_original_logits_at_every_layer(kind):
    model, _ = build_tiny(kind, layers=4)
    ids = torch.randint(3, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 1
    L = len(model.model.layers)
    hidden, states = original_forward(model, ids, list(range(L + 1)))
    with torch.no_grad():
        logits = lm_logits(model, hidden)
        torch.testing.assert_close(logits, model(input_ids=ids, use_cache=False).logits.float())
    for layer in range(1, L + 1):
        with torch.no_grad():
            hybrid = suffix_logits(suffix_model(model, layer), states[layer])
        torch.testing.assert_close(hybrid, logits, atol=1e-5, rtol=1e-5, msg=f"layer {layer}")
    # the original model is untouched by building suffixes
    again, _ = original_forward(model, ids, [0])
    torch.testing.assert_close(again, hidden)


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


def test_fidelity_in_slices_of_positions_equals_one_pass_and_soft_capping_is_kept():
    """Fidelity computed over 4-row slices of positions equals the whole-tensor computation, and
    lm_logits applies Gemma's final logit soft-capping as the model's own forward does."""
    from dihal.stages.fidelity import evaluate_fidelity

    model, _ = build_tiny("gemma3", layers=4)
    model.config.final_logit_softcapping = 3.0
    ids = torch.randint(3, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = 1
    hidden, _ = original_forward(model, ids, [0])
    with torch.no_grad():
        torch.testing.assert_close(lm_logits(model, hidden), model(input_ids=ids, use_cache=False).logits.float())

    class NoisyOracle:  # the true h_2 plus fixed noise: a bridge with a known error
        layer, start = 2, 1

        def __init__(self):
            self.norm = type("N", (), {"mu_y": torch.zeros(32)})()

        def noise(self, b, t, gen):
            return torch.randn(b, t, 32, generator=gen)

        def sample(self, h0, steps, noise):
            return original_forward(model, ids_now[0], [2])[1][2] + 0.3 * noise / steps

    ids_now = [None]
    results = []
    for rows in (4, 10**6):
        totals = []
        for start in range(0, 3, 2):  # evaluate_fidelity batches; keep the oracle's ids in step
            ids_now[0] = ids[start : start + 2]
            totals.append(evaluate_fidelity(model, NoisyOracle(), ids_now[0], [1, 2], batch_size=2, rows=rows))
        results.append(totals)
    for a, b in zip(results[0], results[1]):
        for steps in (1, 2):
            for key, value in a[steps].metrics().items():
                assert value == pytest.approx(b[steps].metrics()[key], rel=1e-5, abs=1e-7), key
            by_pos_a, by_pos_b = a[steps].position_metrics(), b[steps].position_metrics()
            assert [r["position"] for r in by_pos_a] == list(range(1, 20))
            for ra, rb in zip(by_pos_a, by_pos_b):
                assert ra["kl"] == pytest.approx(rb["kl"], rel=1e-5, abs=1e-7)
            # the per-position means, weighted by their counts, are the overall means
            n = sum(r["n"] for r in by_pos_a)
            assert sum(r["kl"] * r["n"] for r in by_pos_a) / n == pytest.approx(a[steps].metrics()["kl"], rel=1e-6)
            agree = sum(r["top1_agreement"] * r["n"] for r in by_pos_a) / n
            assert agree == pytest.approx(a[steps].metrics()["top1_agreement"], rel=1e-9)
    first = results[0][0][1].metrics()
    assert 0 < first["kl"] and first["top1_agreement"] <= 1

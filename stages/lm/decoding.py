"""One decoding for every recovery that ends in a distribution over the vocabulary (METHOD
§5): the AR references, the hybrid, CoDAR's and LD4LG-style decoders, DiHAL's upper blocks.

    temperature 0   argmax
    temperature t   softmax(logits / t) restricted to top-k and to the smallest nucleus reaching
                    top-p, sampled in float64 (in float32 the tail of a 150k vocabulary rounds to
                    zero and the cumulative sum drifts, as MDLM and DUO found)

The draws come from the generator the caller passes, on its device: a CPU one (on a CPU, the tokens
every CPU artifact was made with), or on a GPU the device's own (`dihal generate`), so that a token's
logits, probabilities and draw never leave the device.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0, gen=None) -> torch.Tensor:
    """(..., V) logits -> (...) token ids."""
    if temperature == 0:
        return logits.argmax(-1)
    shape, logits = logits.shape[:-1], logits.reshape(-1, logits.shape[-1]).double() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    where = gen.device if gen is not None else probs.device  # no copy where the generator is the logits'
    return torch.multinomial(probs.to(where), 1, generator=gen)[:, 0].to(logits.device).reshape(shape)


def describe(temperature: float | None, top_p: float, top_k: int = 0) -> dict:
    """What a row's manifest records as the decoding it actually used."""
    if temperature is None:
        return {"rule": "cosine rounding (deterministic)"}
    return {
        "rule": "argmax" if temperature == 0 else "sampled, float64",
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
    }

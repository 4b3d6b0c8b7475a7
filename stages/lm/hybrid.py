"""The hybrid model of METHOD §3: bridge -> original blocks l+1..L -> final norm -> LM head.

The upper part is a *suffix model*: an instance of the backbone's own class whose blocks are
the backbone's block objects l+1..L (shallow copies that share every parameter, renumbered
so the KV cache and per-layer attention types line up), fed with `inputs_embeds`. Rotary
embeddings, masks, Gemma's sliding windows, logit soft-capping and the cache all behave as
in the original, because they are the original code.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import nn


def _renumbered(block: nn.Module, index: int) -> nn.Module:
    """A shallow copy of a decoder block (parameters shared) that believes it is layer `index`."""
    new_block = copy.copy(block)
    new_block._modules = dict(block._modules)
    if hasattr(new_block, "layer_idx"):
        new_block.layer_idx = index
    attn = block._modules.get("self_attn")
    if attn is not None:
        new_attn = copy.copy(attn)
        new_attn._modules = dict(attn._modules)
        new_attn.layer_idx = index
        new_block._modules["self_attn"] = new_attn
    return new_block


def suffix_model(model: nn.Module, layer: int) -> nn.Module:
    """Blocks layer+1..L (1-based), final norm and LM head of `model`, sharing its weights."""
    config = copy.deepcopy(model.config)
    blocks = list(model.model.layers)[layer:]
    config.num_hidden_layers = len(blocks)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[layer:]
    with torch.device("meta"):
        suffix = type(model)(config)
    suffix.model.layers = nn.ModuleList(_renumbered(b, i) for i, b in enumerate(blocks))
    suffix.model.embed_tokens = model.model.embed_tokens  # unused (inputs_embeds), kept off the meta device
    suffix.model.norm = model.model.norm
    suffix.model.rotary_emb = model.model.rotary_emb
    suffix.lm_head = model.lm_head
    for name, module in list(suffix.model.named_children()):
        if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
            setattr(suffix.model, name, getattr(model.model, name))
    return suffix.eval()


def suffix_hidden(suffix: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """Teacher-forced final hidden states (after the final norm) from layer-l states (B, T, D)."""
    dtype = next(suffix.parameters()).dtype
    return suffix.model(inputs_embeds=states.to(dtype), use_cache=False).last_hidden_state


def suffix_logits(suffix: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits from layer-l states (B, T, D), no cache (all of them: small inputs only)."""
    return lm_logits(suffix, suffix_hidden(suffix, states))


_FLOAT32_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lm_head -> its float32 weight, once


def lm_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head (and Gemma's final logit soft-capping, where set) on final hidden states, computed
    in float32 whatever the model's dtype: a bfloat16 head gives KL 5.2e-4 and top-1 agreement 0.977
    against a float32 one on the same states, a floor under fidelity that no bridge causes. The
    float32 copy of the head's weight is made once per model. Callers pass slices of positions, so
    (B, T, V) is never materialized for a large vocabulary."""
    head = model.lm_head
    weight = head.weight
    if weight.dtype != torch.float32:
        weight = _FLOAT32_HEADS.get(head)
        if weight is None:
            weight = _FLOAT32_HEADS[head] = head.weight.detach().float()
    bias = head.bias.float() if getattr(head, "bias", None) is not None else None
    logits = F.linear(hidden.float(), weight, bias)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def original_forward(model: nn.Module, input_ids: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, dict]:
    """Final hidden states (after the final norm; lm_logits turns them into logits) plus the residual
    states at `layers` (METHOD §0)."""
    from dihal.stages.lm.capture import capture_layers

    with torch.no_grad(), capture_layers(model, layers, stop_early=False) as captured:
        hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return hidden, {k: v.float() for k, v in captured.items()}

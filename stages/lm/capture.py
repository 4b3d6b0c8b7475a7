"""Capture residual-stream states with forward hooks (METHOD §0).

Layer 0 = the input of block 1 (a forward pre-hook, so model-specific embedding scaling such
as Gemma's sqrt(d) is included); layer l >= 1 = the output of block l (a forward hook), which
for l = L is the pre-norm output of the last block. The forward pass stops right after the
deepest requested block, so neither later blocks nor the LM head run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dihal.artifacts.errors import DihalError


class _StopForward(Exception):
    pass


def first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return value[0]
    return value[0] if hasattr(value, "__getitem__") else value


@contextlib.contextmanager
def capture_layers(
    model: torch.nn.Module, layers: list[int], stop_early: bool = True
) -> Iterator[dict[int, torch.Tensor]]:
    """Yields a dict filled with {layer: (batch, seq, D) tensor} by each forward call."""
    blocks = model.model.layers
    captured: dict[int, torch.Tensor] = {}
    deepest = max(layers)
    handles = []

    def pre_hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        captured[0] = hidden.detach()
        if stop_early and deepest == 0:
            raise _StopForward

    def make_hook(layer: int):
        def hook(module, args, output):
            captured[layer] = first_tensor(output).detach()
            if stop_early and layer == deepest:
                raise _StopForward

        return hook

    if 0 in layers:
        handles.append(blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
    for layer in sorted(set(layers) - {0}):
        handles.append(blocks[layer - 1].register_forward_hook(make_hook(layer)))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def run_capture(
    model: torch.nn.Module, captured: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> dict[int, torch.Tensor]:
    """One forward inside capture_layers; returns a copy of what was captured."""
    captured.clear()
    try:
        model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _StopForward:
        pass
    return dict(captured)


def hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    with torch.no_grad(), capture_layers(model, layers) as captured:
        return run_capture(model, captured, input_ids)


class ModelStates:
    """--states model (train-bridge, train-prior, sweep, confirm): layer l's states of token ids from the
    backbone's first l blocks, run on the training device in the training precision (the forward stops after
    block l: nothing above it runs), as float32. What the extract would have stored for the same sequences,
    without its rounding to float16."""

    def __init__(self, model, layer: int):
        blocks = len(model.model.layers)
        if layer > blocks:
            raise DihalError(
                f"--states model runs the backbone's first {layer} blocks, but it has {blocks}; "
                f"use --layer {blocks} or fewer"
            )
        self.model, self.layer, self.width = model, layer, model.config.hidden_size
        self.device = next(model.parameters()).device

    def __call__(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids).to(self.device).long()
        return hidden_states(self.model, ids, [self.layer])[self.layer].float()

    def blocks(self, ids):
        """The states of (N, T) token ids, ROWS sequences a forward pass, in order, on the host: what a pass over
        many sequences reads (the normaliser's moments, the oracle's held-out states)."""
        for s in range(0, len(ids), self.ROWS):
            yield self(ids[s : s + self.ROWS]).cpu()

    ROWS = 64  # sequences per forward pass of the backbone over many sequences

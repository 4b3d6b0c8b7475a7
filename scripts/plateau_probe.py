"""What a bridge on the validation-loss plateau has not learned (issue 66): its validation loss as trained, and
again with every attention layer of its denoiser held to the query's own position (each position then a function
of its own condition and noise alone, no context), with the skip A c alone beside them. A bridge that has left the
plateau should lose much more without context than one still on it.

    python scripts/plateau_probe.py --root runs/main-smollm2-135m --extract 847a03ee1499 eb83aff9080d 998fd7069138
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from dihal.stages.diffusion import denoiser, flow
from dihal.stages.parts.bridge import Bridge


@contextlib.contextmanager
def own_position_only():
    """Every scaled_dot_product_attention in the denoiser attends the query's own key alone (queries are the last
    n of the keys, as in every causal call there)."""
    plain = F.scaled_dot_product_attention

    def diagonal(q, k, v, attn_mask=None, is_causal=False):
        n, m = q.shape[-2], k.shape[-2]
        mask = torch.zeros(n, m, dtype=torch.bool, device=q.device)
        mask[torch.arange(n), torch.arange(m - n, m)] = True
        return plain(q, k, v, attn_mask=mask)

    denoiser.F.scaled_dot_product_attention = diagonal
    try:
        yield
    finally:
        denoiser.F.scaled_dot_product_attention = plain


class SkipOnly(torch.nn.Module):
    """The bridge's output with f(x_t, t, c) removed: A c alone, the per-token linear map it starts from."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x_t, t, c):
        return self.net.skip(c)


def probe(store: ArtifactStore, extract_id: str, bridge_id: str) -> dict:
    art = store.load("bridge", bridge_id)
    bridge = Bridge.load(art)
    group = hs.open_group(store.load("extract", extract_id))
    val = hs.split_indices(group, "validation")[: art.config["val_sequences"]]
    start = bridge.start
    c = bridge.norm.c(torch.from_numpy(hs.read_sequences(group, 0, val)[:, start:]).float())
    y = bridge.norm.y(torch.from_numpy(hs.read_sequences(group, bridge.layer, val)[:, start:]).float())
    row = {"bridge": bridge_id, "lr": art.config["lr"], "seed": art.config["seed"], "sequences": len(val)}
    row["val_loss"] = flow.validation_loss(bridge.net, y, c, bridge.prediction)
    with own_position_only():
        row["own_position_only"] = flow.validation_loss(bridge.net, y, c, bridge.prediction)
    row["skip_only"] = flow.validation_loss(SkipOnly(bridge.net), y, c, bridge.prediction)
    row["context_share"] = 1 - row["val_loss"] / row["own_position_only"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bridges", nargs="+")
    p.add_argument("--root", default="runs")
    p.add_argument("--extract", required=True, help="the extract the bridges trained on")
    a = p.parse_args()
    store = ArtifactStore(a.root)
    for b in a.bridges:
        print(json.dumps(probe(store, a.extract, b)), flush=True)


if __name__ == "__main__":
    main()

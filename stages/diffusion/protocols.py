"""Named training protocols shared by every trained part (bridge, prior, decoder): one fixed set of
settings per name, so that parts trained under one name got the same budget (steps x batch x
tokens). Every field can be overridden by name; a name that is not a field is refused.
"""

from __future__ import annotations

from dataclasses import fields

from artifacts.errors import DihalError

# the CPU protocols share one network and batch; each names only what it changes
_CPU = dict(epochs=None, batch_size=32, schedule="cosine", width=256, depth=4, heads=4, val_sequences=64)

PROTOCOLS: dict[str, dict] = {
    # the measurement setting of docs/method.md section 2 with 1000 steps instead of 600 (about 7 minutes
    # on two CPU cores for smollm2-135m): at layer 3, 600 steps gave top-1 0.642 at 8 steps, 1000 gave 0.659
    "cpu-small": dict(_CPU, steps=1000, lr=1e-3, warmup=30, ema=0.995, eval_every=100, checkpoint_every=50),
    # one fixed short budget per layer for sweeps (under 2 minutes a layer on CPU)
    "sweep-tiny": dict(_CPU, steps=150, lr=2e-3, warmup=15, ema=0.99, eval_every=75, checkpoint_every=50),
    # the comparison on two CPU cores: every part (priors, decoder, bridges) gets this budget, so that
    # `dihal compare` with two seeds and N = 256 samples per row fits in two hours
    "compare-cpu": dict(_CPU, steps=200, lr=2e-3, warmup=20, ema=0.99, eval_every=100, checkpoint_every=50),
    # GPU scale, as in the paper: one epoch over the train split
    "paper": dict(
        steps=None,
        epochs=1,
        batch_size=64,
        lr=3e-4,
        warmup=500,
        schedule="cosine",
        ema=0.9999,
        width=1024,
        depth=8,
        heads=16,
        eval_every=1000,
        checkpoint_every=1000,
        val_sequences=512,
    ),
}


def from_protocol(cls, protocol: str, overrides: dict, **fixed):
    """cls built from PROTOCOLS[protocol] (the fields cls has), the non-None overrides, and `fixed`
    (fields the caller sets, such as the layer). Unknown names are refused, never dropped."""
    if protocol not in PROTOCOLS:
        raise DihalError(f"unknown --protocol '{protocol}'; use one of {', '.join(PROTOCOLS)}")
    names = {f.name for f in fields(cls)}
    known = names - set(fixed) - {"protocol"}
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise DihalError(f"unknown setting '{unknown[0]}'; settings are {', '.join(sorted(known))}")
    base = {k: v for k, v in PROTOCOLS[protocol].items() if k in names}
    values = {**base, **{k: v for k, v in overrides.items() if v is not None}}
    if overrides.get("epochs") is not None and overrides.get("steps") is None:
        values["steps"] = None  # --epochs alone: the run length comes from the epochs
    return cls(protocol=protocol, **fixed, **values)

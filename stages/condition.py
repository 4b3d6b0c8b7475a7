"""The corrupted conditions a recovery trains on (METHOD §5, --condition-noise): `sigma:S`
is c + sigma z (stages/diffusion/flow.py corrupt); `prior:T` is the trained layer-0 prior's own x0
estimate of c noised to t <= T. Shared by the bridge's and the decoder's training."""

from __future__ import annotations

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact


def condition_prior(prior_art: Artifact | None, cfg):
    """The loaded prior of --condition-noise prior:T (on the training device), else None."""
    if cfg.condition_from != "prior":
        return None
    from dihal.stages.parts.prior import Prior

    device = cfg.device if cfg.device != "auto" else "cpu"
    return Prior.load(prior_art, device)


def check_condition_prior(cfg, extract: Artifact, prior_art: Artifact | None) -> dict[str, str]:
    """The parents a part gains from its condition: {} for sigma:S, {"prior": id} for prior:T."""
    if cfg.condition_from != "prior":
        if prior_art is not None:
            raise DihalError("--prior is for --condition-noise prior:T; leave it out with sigma:S")
        return {}
    if prior_art is None:
        raise DihalError("--condition-noise prior:T needs --prior ID (a `dihal train-prior --layer 0` artifact)")
    if prior_art.manifest.get("parents", {}).get("extract") != extract.id or prior_art.config.get("layer") != 0:
        raise DihalError(f"prior {prior_art.id} is not a prior over layer 0 of extract {extract.id}; train one on it")
    return {"prior": prior_art.id}

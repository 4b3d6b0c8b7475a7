"""Where the project grows: the score's proxies, the token recoveries and the comparison's rows.

Adding a proxy, a recovery or a comparison row is one entry here plus its own code. Entries name
their code as "module:attribute" and import it on first use (as entry points do), so this module
imports nothing heavy and the CLI can list every name without loading torch.

    PROXIES     name -> Proxy(sign, in_score, fn): `dihal score` computes every one per layer,
                S sums the z-scores of those with in_score (times their sign), and `dihal sweep`
                ranks the layers by each one with a sign (lm-eval's `higher_is_better`)
    RECOVERIES  name -> Recovery(needs, fn): how `dihal generate --mode parallel` maps prior
                samples to tokens, and which trained part (if any) it needs
    ROWS        the comparison's rows (METHOD §5): a prior, a recovery and the
                parts they need; `dihal compare` trains each distinct part once per seed
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


def resolve(target: str):
    """'package.module:attribute' -> the attribute, imported now."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


# -- proxies of the locate step (METHOD §1) --------------------------------------------------
@dataclass(frozen=True)
class Proxy:
    name: str
    sign: int | None  # +1: higher = easier to bridge; -1: lower = easier; None: reported, ranks nothing
    in_score: bool  # its z-score (times sign) is a term of S
    fn: str  # "module:function" of a score.Geometry (one layer's sampled states) -> float
    doc: str
    embeddings: bool = False  # reads the token embeddings at the same positions (score.Embeddings)

    @property
    def predictor(self) -> str:
        """Its name as a predictor of -loss in `dihal sweep`: '-k_hat alone' ranks by -k_hat."""
        return f"{'-' if self.sign < 0 else ''}{self.name} alone"


_SCORE = "dihal.stages.score"
PROXIES: dict[str, Proxy] = {
    p.name: p
    for p in (
        Proxy("m_curv", +1, True, f"{_SCORE}:m_curv", "median 1/lambda_max of k-NN covariances"),
        Proxy("m_mono", +1, True, f"{_SCORE}:m_mono", "median v'Pv / v'v over random pairs"),
        Proxy("k_hat", -1, True, f"{_SCORE}:k_hat", "effective rank tr(Sigma) / lambda_max"),
        Proxy("participation_ratio", None, False, f"{_SCORE}:participation_ratio", "tr(Sigma)^2 / tr(Sigma^2)"),
        Proxy("entropy_rank", None, False, f"{_SCORE}:entropy_rank", "exp of the spectrum's entropy"),
        # dihal's own, not the paper's: how much of h_l a ridge map from the token embeddings explains
        Proxy("r2_token", +1, False, f"{_SCORE}:r2_token", "held-out R^2 of h_0 -> h_l, the token alone", True),
        Proxy("r2_context", +1, False, f"{_SCORE}:r2_context", "held-out R^2 of h_0 -> h_l, 4-token window", True),
        Proxy("r2_token_penalty", None, False, f"{_SCORE}:r2_token_penalty", "its GCV ridge penalty, x rows", True),
        Proxy("r2_context_penalty", None, False, f"{_SCORE}:r2_context_penalty", "its GCV ridge penalty, x rows", True),
    )
}


PROXY_SETS = ("all", "paper")  # `dihal score --proxies`: every registered proxy, or the paper's alone (S)


def proxy_set(which: str) -> dict[str, Proxy]:
    """The proxies a score of --proxies `which` computes: all of them, or the paper's (the terms of S)."""
    return dict(PROXIES) if which == "all" else {k: p for k, p in PROXIES.items() if p.in_score}


def score_terms() -> list[Proxy]:
    """The proxies S is made of, in order."""
    return [p for p in PROXIES.values() if p.in_score]


def predictors() -> list[Proxy]:
    """The proxies a sweep ranks the layers by, each alone."""
    return [p for p in PROXIES.values() if p.sign is not None]


# -- recoveries of the comparison (METHOD §5) ------------------------------------------------
@dataclass(frozen=True)
class Recovery:
    name: str
    needs: str | None  # the stage of the part it needs beside a prior over h_0 ("bridge", "decoder"), or None
    fn: str  # "module:Class"; Class(loaded, prior, part, cfg) has .tokens(block, first) -> (B, T') ids
    doc: str


_RECOVER = "dihal.stages.recover"
RECOVERIES: dict[str, Recovery] = {
    r.name: r
    for r in (
        Recovery("rounding", None, f"{_RECOVER}:Rounding", "nearest token embedding (Diffusion-LM, SED)"),
        Recovery("decoder", "decoder", f"{_RECOVER}:DecoderRecovery", "a decoder cross-attending to e (CoDAR)"),
        Recovery("hidden", "bridge", f"{_RECOVER}:Hidden", "bridge -> upper blocks -> LM head (DiHAL)"),
        Recovery("latent", "autoencoder", f"{_RECOVER}:LatentRecovery", "an autoencoder's decoder (LD4LG-style)"),
    )
}


# -- the comparison's rows ----------------------------------------------------------------------------------
# A layer is named by what it is: "l_star", "worst" (argmin S), "oracle" (a sweep's, when given) or "0".
#
# A part is what a row trains: its class says which stage trains it (`run`, "module:function"), from which
# config (`config`, a stages/configs.py class, built with `for_run` under the comparison's one protocol),
# with which of its own fields (`fields`), and its label. dihal compare builds every part the same way
# (compare.part_configs), so a new kind of part is one class here and the Row that uses it.
_CONFIGS = "dihal.stages.configs"


@dataclass(frozen=True)
class PriorPart:
    layer: str = "0"  # "0": normalized h_0; a named layer: DiHAL-direct's prior over h_l
    self_condition: bool = False
    latent: bool = False  # over the autoencoder's latents (LD4LG-style)

    stage, run, config = "prior", "dihal.stages.train_prior:run", f"{_CONFIGS}:PriorConfig"
    fixed_depth = reads_backbone = False

    def fields(self, layers: dict[str, int], condition: dict, prior: dict) -> dict:
        """prior: the comparison's remedies (--prior-*), for every prior over h_0 (they read its tokens)."""
        over_h0 = self.layer == "0" and not self.latent
        own = {"layer": layers[self.layer], "self_condition": self.self_condition, "latent": self.latent}
        return {**own, **(prior if over_h0 else {})}

    def label(self, layers: dict[str, int]) -> str:
        if self.latent:
            return "prior over latents"
        if self.layer != "0":
            return f"prior over h_{layers[self.layer]}"
        return "prior (self-conditioned)" if self.self_condition else "prior"


@dataclass(frozen=True)
class DecoderPart:
    stage, run, config = "decoder", "dihal.stages.train_decoder:run", f"{_CONFIGS}:DecoderTrainConfig"
    fixed_depth = reads_backbone = True  # depth DECODER_DEPTH; the backbone's frozen embedding table

    def fields(self, layers: dict[str, int], condition: dict, prior: dict) -> dict:
        return condition

    def label(self, layers: dict[str, int]) -> str:
        return "decoder"


@dataclass(frozen=True)
class AutoencoderPart:
    stage, run, config = "autoencoder", "dihal.stages.train_autoencoder:run", f"{_CONFIGS}:AutoencoderConfig"
    fixed_depth = reads_backbone = True  # its decoder's and resampler's depths are fixed; the backbone encodes

    def fields(self, layers: dict[str, int], condition: dict, prior: dict) -> dict:
        return {}

    def label(self, layers: dict[str, int]) -> str:
        return "autoencoder"


@dataclass(frozen=True)
class BridgePart:
    layer: str
    noisy: bool = True  # trained on corrupted conditions (--condition-noise); False: METHOD §2's bridge

    stage, run, config = "bridge", "dihal.stages.train_bridge:run", f"{_CONFIGS}:BridgeConfig"
    fixed_depth = reads_backbone = False

    def fields(self, layers: dict[str, int], condition: dict, prior: dict) -> dict:
        return {"layer": layers[self.layer], **(condition if self.noisy else {"condition_noise": 0.0})}

    def label(self, layers: dict[str, int]) -> str:
        return f"bridge L{layers[self.layer]} ({'noisy c' if self.noisy else 'section 2'})"


@dataclass(frozen=True)
class Row:
    key: str  # its name on the command line (--rows, --controls)
    name: str  # "{l}" stands for the layer of its bridge (or of its prior)
    prior: PriorPart
    recovery: str  # a RECOVERIES name
    part: BridgePart | DecoderPart | AutoencoderPart | None = None
    clamp: bool = False  # Diffusion-LM's clamping of each prior step's x0 estimate
    needs_oracle: bool = False  # only when a sweep's oracle layer is given
    baseline: bool = False  # claim 3 compares DiHAL (l*) with it
    ours: bool = False  # the row claim 3 is about
    readout: str = "independent"  # hidden rows: how tokens are read from the upper blocks' logits (METHOD §5.1)
    controls_of: str | None = None  # the row whose --controls entry gives it the oracle and null priors too

    @property
    def cost(self) -> str:
        """Its cost class (METHOD §5.1, like with like): one pass over the sequence, token by token, or
        refine (K more passes)."""
        if self.recovery in ("decoder", "latent") or self.readout == "causal":
            return "token-by-token"
        return "refine" if self.readout.startswith("refine") else "one-pass"

    @property
    def curve(self) -> bool:
        """It ends in a distribution, so it is decoded at every temperature of the grid; rounding
        rows are single points."""
        return self.recovery != "rounding"

    def parts(self) -> list:
        """In training order: a prior over latents after the autoencoder that makes them."""
        parts = [self.prior] + ([self.part] if self.part is not None else [])
        return parts[::-1] if self.prior.latent else parts

    def label(self, layers: dict) -> str:
        """layers: what each layer name stands for, and "backbone" (the model's short name)."""
        ref = self.part.layer if isinstance(self.part, BridgePart) else self.prior.layer
        return self.name.format(l=layers.get(ref), backbone=layers.get("backbone", "the backbone"))


ROWS: tuple[Row, ...] = (
    Row("diffusion-lm", "Diffusion-LM", PriorPart(), "rounding", clamp=True, baseline=True),
    Row("sed", "SED", PriorPart(self_condition=True), "rounding", baseline=True),
    Row("codar", "CoDAR", PriorPart(), "decoder", DecoderPart(), baseline=True),
    Row(
        "ld4lg",
        "LD4LG-style (frozen {backbone} encoder)",
        PriorPart(latent=True),
        "latent",
        AutoencoderPart(),
        baseline=True,
    ),
    Row("dihal", "DiHAL (l*={l})", PriorPart(), "hidden", BridgePart("l_star"), ours=True),
    Row("dihal-worst", "DiHAL (argmin S={l})", PriorPart(), "hidden", BridgePart("worst")),
    Row("dihal-direct", "DiHAL-direct (l*={l})", PriorPart("l_star"), "hidden"),
    Row("dihal-oracle", "DiHAL (oracle={l})", PriorPart(), "hidden", BridgePart("oracle"), needs_oracle=True),
)
ROW_KEYS = tuple(row.key for row in ROWS)


def readout_row(readout: str) -> Row:
    """DiHAL (l*) read by another readout of METHOD §5.1 (`dihal compare --readout`): a row of its own, with
    DiHAL's controls."""
    return Row(
        f"dihal:{readout}",
        f"DiHAL (l*={{l}}), {readout}",
        PriorPart(),
        "hidden",
        BridgePart("l_star"),
        readout=readout,
        controls_of="dihal",
    )


AR_REFERENCE_BRIDGE = BridgePart("l_star", noisy=False)  # the AR hybrid and original references
# what a recovery reads (GenerateConfig.source), as the comparison's tables name it; a label also keeps
# "null" from reading back as NaN in pandas
SOURCE_LABELS = {"prior": "trained prior", "oracle": "oracle prior", "null": "null prior", "data": "data"}

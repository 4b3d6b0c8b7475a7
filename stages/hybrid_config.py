"""The hybrid's transformers config (model_type dihal_hybrid) and its place in transformers' Auto classes.

`import dihal` registers both as soon as transformers is imported (dihal_cli/python/__init__.py), so code that
knows only transformers loads an exported bridge (stages/export.py) with AutoConfig and
AutoModelForCausalLM. This module is small on purpose: registering loads neither the hybrid nor its stages.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from dihal.stages.configs import GenerateConfig

MODEL_TYPE = "dihal_hybrid"


class HybridConfig(PretrainedConfig):
    """The hybrid's config: the bridge's id and layer, its sampling defaults (Euler steps, noise seed) and, for
    an exported bridge, everything config.json holds (the base model, the denoiser, the extract's packing)."""

    model_type = MODEL_TYPE

    def __init__(self, bridge: str = "", layer: int = 0, steps: int = GenerateConfig.sample_steps, seed: int = 0, **kw):
        self.bridge, self.layer, self.steps, self.seed = bridge, layer, steps, seed
        super().__init__(**kw)


def register(model_class) -> None:
    """AutoConfig and AutoModelForCausalLM resolve model_type dihal_hybrid (idempotent); model_class is what
    AutoModelForCausalLM.from_pretrained calls (dihal's package registers a stand-in that imports the hybrid
    only when a model is loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(MODEL_TYPE, HybridConfig, exist_ok=True)
    AutoModelForCausalLM.register(HybridConfig, model_class, exist_ok=True)

"""dihal: locate where a continuous diffusion model should enter a pretrained LM, then put it there.

The command line is `dihal` (dihal.cli); from Python, the names of dihal.api (docs/api.md) are here:

    import dihal
    store = dihal.open_store("runs")
    hybrid = dihal.load_hybrid("latest", root="runs")
    hybrid.save_pretrained("my-bridge")          # the bridge alone (docs/sharing.md)
    hybrid = dihal.from_pretrained("my-bridge")  # anywhere, with no store

They are imported on first use, so `dihal --help` loads neither torch nor pandas. Importing dihal also
registers the hybrid with transformers' AutoConfig and AutoModelForCausalLM, once transformers is imported
(stages/hybrid_config.py), so AutoModelForCausalLM.from_pretrained reads an exported bridge.
"""

import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["open_store", "Store", "Loaded", "score_table", "load_hybrid", "export", "from_pretrained", "import_bridge"]


def __getattr__(name: str):
    if name in __all__:
        from dihal import api

        return getattr(api, name)
    raise AttributeError(f"module 'dihal' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


def _register() -> None:
    try:
        from dihal.stages.hybrid_config import HybridConfig, register

        class HybridForCausalLM:
            """What AutoModelForCausalLM finds for dihal_hybrid: stages/hybrid_lm.py's class, imported on use."""

            config_class = HybridConfig

            @classmethod
            def from_pretrained(cls, *args, **kwargs):
                from dihal.stages.hybrid_lm import HybridForCausalLM as Hybrid

                return Hybrid.from_pretrained(*args, **kwargs)

        register(HybridForCausalLM)
    except Exception as exc:  # noqa: BLE001 - never break the import of transformers itself
        warnings.warn(f"dihal could not register its hybrid with transformers' Auto classes: {exc}", stacklevel=2)


class _AfterTransformers(importlib.abc.MetaPathFinder):
    """Registers the hybrid right after transformers is first imported, so `import dihal` stays light."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


if "transformers" in sys.modules:
    _register()
elif not any(isinstance(f, _AfterTransformers) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterTransformers())

"""dihal: locate where a continuous diffusion model should enter a pretrained LM, then put it there.

The command line is `dihal` (dihal.cli); from Python, the names of dihal.api (docs/api.md) are here:

    import dihal
    store = dihal.open_store("runs")
    hybrid = dihal.load_hybrid("latest", root="runs")

They are imported on first use, so `dihal --help` loads neither torch nor pandas.
"""

__all__ = ["open_store", "Store", "Loaded", "score_table", "load_hybrid"]


def __getattr__(name: str):
    if name in __all__:
        from dihal import api

        return getattr(api, name)
    raise AttributeError(f"module 'dihal' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

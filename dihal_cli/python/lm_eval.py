"""`python -m dihal.lm_eval`: lm-evaluation-harness's own command line, with dihal's hybrid registered as
`--model dihal` (docs/sharing.md). Every flag of the harness works (--tasks, --include_path, --num_fewshot,
--output_path, --log_samples, --limit, ...):

    python -m dihal.lm_eval --model dihal --model_args pretrained=FOLDER_OR_HUB_ID[,base_model=PATH] --tasks T
    python -m dihal.lm_eval --model dihal --model_args bridge=ID,root=runs --tasks T
    python -m dihal.lm_eval --model hf --model_args pretrained=FOLDER[,base_model=PATH] --tasks T

model_args of `dihal`: pretrained (an exported bridge) or bridge (a store id, with root), base_model,
check_base, steps, seed, dtype, trust_remote_code; the rest go to the harness's HFLM (batch_size, max_length,
...). The `hf` model reads an exported folder through transformers' AutoModelForCausalLM, which `import dihal`
taught the hybrid. The harness is an optional extra: pip install 'dihal[eval]'.
"""

from __future__ import annotations

import sys

try:
    import lm_eval  # noqa: F401
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError:  # pragma: no cover - the harness is an optional extra
    print("error: python -m dihal.lm_eval needs lm-evaluation-harness; pip install 'dihal[eval]'", file=sys.stderr)
    raise SystemExit(2) from None


HARNESS_DEVICE = "cuda:0"  # the harness's --device when none is given


@register_model("dihal")
class DihalLM(HFLM):
    """The harness's HFLM on a dihal hybrid: an exported bridge (pretrained=) or a store's (bridge=, root=)."""

    TEXT = ("pretrained", "bridge", "root", "base_model")  # ids and paths, never numbers

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """The harness's own parse, but a store id or a path stays the text it was: the harness reads every value
        that looks like a number as one, so bridge=8e7362519074 became inf and bridge=012345678901 lost its 0."""
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        for item in (arg_string or "").split(","):
            key, _, value = item.partition("=")
            if key.strip() in cls.TEXT:
                args[key.strip()] = value
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**args, **extra)

    def __init__(
        self,
        pretrained: str | None = None,
        bridge: str | None = None,
        root: str | None = None,
        base_model: str | None = None,
        check_base: bool = True,
        steps: int | None = None,
        seed: int = 0,
        device: str | None = None,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        max_length: int | None = None,
        **kwargs,
    ):
        import dihal

        if (pretrained is None) == (bridge is None):
            raise ValueError("--model dihal: give model_args pretrained=FOLDER_OR_HUB_ID or bridge=ID (with root=)")
        import torch

        if device in (None, HARNESS_DEVICE) and not torch.cuda.is_available():  # the harness's default, as HFLM does
            print("dihal: no CUDA device; the hybrid runs on cpu (give --device to choose)", file=sys.stderr)
            device = "cpu"
        if pretrained is not None:
            hybrid = dihal.from_pretrained(
                pretrained,
                base_model=base_model,
                check_base=check_base,
                steps=steps,
                seed=seed,
                device=device,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
            )
        else:
            hybrid = dihal.load_hybrid(
                str(bridge),
                root=root,
                device=device,
                dtype=dtype,
                steps=steps,
                seed=seed,
                trust_remote_code=trust_remote_code,
            )
        super().__init__(
            pretrained=hybrid,
            tokenizer=hybrid.tokenizer,
            backend="causal",
            max_length=max_length or hybrid.positions,
            **kwargs,
        )


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()

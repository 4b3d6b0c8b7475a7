"""A Hugging Face model directory with a paper backbone's shapes and random weights.

scripts/gpu_smoke.sh checks dihal's GPU paths at D = 4096 and the 128k / 152k vocabularies without
the 16 GB downloads (a GPU machine here has no network, and the builtins' packages are too large to
send). The directory holds the real config of Llama-3.1-8B-Instruct or Qwen3-8B with --layers
blocks, random bfloat16 weights, and the tokenizer of the builtin smollm2-135m (49,152 ids, all
inside either vocabulary, so every vocabulary-sized tensor has its real size), given the special tokens
of the model's own: a Llama-like one starts with <|begin_of_text|>, ends a turn with <|eot_id|> and a
document with <|end_of_text|>; a Qwen3-like one has no BOS (its sequences start with <|endoftext|>) and
ends a turn with <|im_end|>. Each has the published generation_config's list of stop tokens.

    python scripts/make_random_model.py --like llama-3.1-8b --layers 4 --out runs/random-llama
    dihal extract --model runs/random-llama --device cuda --dtype bfloat16 ...

--hidden, --intermediate, --heads and --kv-heads shrink the blocks for a CPU rehearsal
(DEVICE=cpu scripts/gpu_smoke.sh); the vocabulary keeps its size unless --vocab shrinks it too (with a
small --tokenizer: tests/test_paper_script.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# the published config.json of each model, less the fields transformers fills in itself
LIKE = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
}
# the special tokens each model's own tokenizer starts, joins and ends text with (stages/lm/tokens.py):
# (bos, eos, [tokens added], generation_config.eos_token_id as token names); the builtin tokenizer already has
# Qwen's <|endoftext|> and <|im_end|>
SPECIALS = {
    "llama-3.1-8b": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"],
        ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    ),
    "qwen3-8b": (None, "<|im_end|>", ["<|endoftext|>", "<|im_end|>"], ["<|im_end|>", "<|endoftext|>"]),
}


def builtin_tokenizer_dir() -> Path:
    """The converted directory of the builtin smollm2-135m (its tokenizer.json is 3.5 MB)."""
    from dihal.stages.lm.models import locate

    return Path(locate("smollm2-135m")[0])


def make(like: str, layers: int, out: Path, tokenizer: Path, device: str, seed: int = 0, **shrink) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    bos, eos, added, stops = SPECIALS[like]
    tok.add_special_tokens({"additional_special_tokens": [t for t in added if t not in tok.get_vocab()]})
    tok.bos_token, tok.eos_token = bos, eos
    fields = {**LIKE[like], "num_hidden_layers": layers, **{k: v for k, v in shrink.items() if v is not None}}
    if shrink.get("hidden_size") and "head_dim" in fields:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields["vocab_size"] < len(tok):
        raise SystemExit(f"--vocab {fields['vocab_size']} is smaller than the tokenizer's {len(tok)} ids")
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids(added[1])
    fields.update(bos_token_id=start, eos_token_id=tok.eos_token_id, pad_token_id=pad)
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=start, eos_token_id=[tok.convert_tokens_to_ids(t) for t in stops], pad_token_id=pad
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "random_model.json").write_text(json.dumps({"like": like, "layers": layers, "seed": seed, **shrink}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--like", choices=sorted(LIKE), required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, default=None, help="A tokenizer directory (default: smollm2-135m's).")
    p.add_argument("--device", default=None, help="Where the weights are drawn (default: cuda if there, else cpu).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=None, help="Shrink: hidden size (a CPU rehearsal).")
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None, help="Shrink: vocabulary size (at least the tokenizer's).")
    a = p.parse_args()
    if a.layers < 2:
        p.error("--layers must be at least 2 (the score z-scores layers 1..L-1)")
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shrink = dict(
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        vocab_size=a.vocab,
    )
    out = make(a.like, a.layers, a.out, a.tokenizer or builtin_tokenizer_dir(), device, a.seed, **shrink)
    print(f"{out}: {a.like} shapes, {a.layers} blocks, random bfloat16 weights")


if __name__ == "__main__":
    main()

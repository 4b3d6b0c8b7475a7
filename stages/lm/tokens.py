"""The tokens that start, join and end text (METHOD §0).

start       every sequence's first token: BOS, else the document separator <|endoftext|> (Qwen2/Qwen3 have
            no BOS), else EOS
document    what joins two documents in a packed sequence: the pretraining end-of-document token where
            EOS ends a chat turn (Llama-3.1-Instruct's <|eot_id|>, Qwen3's and SmolLM2-Instruct's
            <|im_end|>) and the vocabulary has one (<|end_of_text|>, <|endoftext|>); else EOS
stops       where a sample ends: EOS, the document end and every id of the model's
            generation_config.eos_token_id
"""

from __future__ import annotations

from dihal.artifacts.errors import DihalError

CHAT_TURN_ENDS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|eom_id|>")
DOCUMENT_ENDS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")  # pretraining ends, in this order


def start_token(tokenizer) -> tuple[int, str]:
    """(id, which) of the token every sequence starts with: BOS, else the document separator
    <|endoftext|> (Qwen2/Qwen3 have no BOS), else EOS."""
    if tokenizer.bos_token_id is not None:
        return int(tokenizer.bos_token_id), "bos"
    separator = tokenizer.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tokenizer.get_vocab() else None
    if separator is not None:
        return int(separator), "<|endoftext|>"
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id), "eos"
    raise DihalError(
        "the tokenizer has no BOS, no <|endoftext|> and no EOS token to start sequences with; "
        "use a tokenizer that has one"
    )


def document_end(tokenizer) -> dict | None:
    """{"id", "token", "kind"} of the token documents are joined by (kind "document end" or "eos"); None
    for a tokenizer without EOS (documents then run on)."""
    eos = tokenizer.eos_token_id
    if tokenizer.eos_token in CHAT_TURN_ENDS:
        vocab = tokenizer.get_vocab()
        for name in DOCUMENT_ENDS:
            if name in vocab and vocab[name] != eos:
                return {"id": int(vocab[name]), "token": name, "kind": "document end"}
    if eos is None:
        return None
    return {"id": int(eos), "token": tokenizer.eos_token, "kind": "eos"}


def stop_ids(tokenizer, generation_config=None) -> frozenset[int]:
    """Every id a sample ends at: EOS, the document end, and generation_config.eos_token_id (an id or a list)."""
    ids = {tokenizer.eos_token_id}
    end = document_end(tokenizer)
    ids.add(end["id"] if end else None)
    listed = getattr(generation_config, "eos_token_id", None)
    ids.update(listed if isinstance(listed, (list, tuple)) else [listed])
    return frozenset(int(i) for i in ids if i is not None)


def truncate(ids: list[int], stops: frozenset[int]) -> list[int]:
    """ids up to (not including) the first stop id."""
    return next((ids[:k] for k, i in enumerate(ids) if i in stops), ids)

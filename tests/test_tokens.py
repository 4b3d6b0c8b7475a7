"""The tokens that join and end text (issue 46): documents are joined by the pretraining end-of-document
token where EOS ends a chat turn (Llama-3.1-Instruct's <|eot_id|>, Qwen3's <|im_end|>), and a sample
ends at any id of the model's generation_config.eos_token_id."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dihal.artifacts.store import ArtifactStore
from dihal.stages.configs import DataConfig
from dihal.stages.lm import tokens
from dihal.stages.text import data as data_mod
from tests.conftest import invoke, tiny_tokenizer


def llama31_instruct_tokenizer():
    """A tiny tokenizer shaped as Llama-3.1-8B-Instruct's: BOS <|begin_of_text|>, EOS <|eot_id|> (the chat
    turn's end) and the pretraining end <|end_of_text|>."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:20]], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", unk_token="<unk>"
    )


@pytest.mark.parametrize(
    "make,want",
    [
        (llama31_instruct_tokenizer, "<|end_of_text|>"),
        (lambda: tiny_tokenizer(bos=False), "<|endoftext|>"),  # Qwen3's shape: EOS <|im_end|>
        (lambda: tiny_tokenizer(bos=True), "<eos>"),  # a base model's EOS is its document end
    ],
)
def test_documents_are_joined_by_the_pretraining_end_of_document_token(make, want, monkeypatch):
    tok = make()
    end = tokens.document_end(tok)
    assert end["token"] == want and end["id"] == tok.convert_tokens_to_ids(want)
    assert end["kind"] == ("eos" if want == tok.eos_token else "document end")
    cfg = DataConfig(seq_len=24, max_sequences=4, val_fraction=0.0)
    docs = ["first short document.", "second one here.", "and a third, longer than the others, to fill."] * 6
    monkeypatch.setattr(data_mod, "documents", lambda c, read=None: iter(docs))
    packed = data_mod.pack(cfg, tok)
    flat = packed.input_ids[:, 1:].reshape(-1).tolist()
    first = tok(docs[0], add_special_tokens=False)["input_ids"]
    assert flat[: len(first) + 1] == first + [end["id"]]  # the first document, then the document end
    if want != tok.eos_token:
        assert tok.eos_token_id not in flat  # the chat turn's end joins nothing
    assert packed.document_end == end


def test_stop_ids_are_eos_the_document_end_and_the_generation_configs_list():
    from transformers import GenerationConfig

    tok = llama31_instruct_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>")}
    listed = GenerationConfig(eos_token_id=[ids["<|end_of_text|>"], ids["<|start_header_id|>"], ids["<|eot_id|>"]])
    assert tokens.stop_ids(tok, listed) == frozenset(ids.values())
    assert tokens.stop_ids(tok, GenerationConfig(eos_token_id=7)) == {7, ids["<|end_of_text|>"], ids["<|eot_id|>"]}
    assert tokens.stop_ids(tok, None) == {ids["<|end_of_text|>"], ids["<|eot_id|>"]}
    assert tokens.truncate([5, 9, 7, 4], frozenset({7, 4})) == [5, 9]
    assert tokens.truncate([5, 9], frozenset({7})) == [5, 9]


def _samples(store) -> list[dict]:
    return [
        json.loads(line) for line in store.resolve("latest", "generate").file("samples.jsonl").read_text().splitlines()
    ]


def test_generate_stops_at_any_id_of_the_models_generation_config(tiny_dirs, tmp_path, root):
    """A tiny model's greedy samples, then the same model with its third token listed in
    generation_config.eos_token_id: the samples end before it."""
    args = ["generate", "--baseline", "original-only", "--num-samples", "2", "--max-new-tokens", "6"]
    args += ["--temperature", "0", "--device", "cpu"]
    assert invoke(*args, "--model", str(tiny_dirs["llama"])).exit_code == 0
    store = ArtifactStore(root)
    ids = _samples(store)[0]["token_ids"]
    assert len(ids) == 6
    third = next(t for t in ids[2:] if t not in ids[:2])  # a token the sample reaches only later
    model = tmp_path / "tiny-llama-stops"
    shutil.copytree(tiny_dirs["llama"], model)
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = [2, third]
    (model / "generation_config.json").write_text(json.dumps(config))
    assert invoke(*args, "--model", str(model)).exit_code == 0
    again = _samples(store)
    assert again[0]["token_ids"] == ids[: ids.index(third)]
    assert np.all([r["n_tokens"] < 6 for r in again])

"""Helpers for the tokenizer tests: byte-level tokens that split characters, a tiny HF tokenizer dir."""

import json

from services.tokenizer.tokenizer import TextTokenizer


def bytes_to_unicode() -> dict[int, str]:
    """The byte ↔ printable-character table of byte-level BPE vocabularies (GPT-2 style)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    num_extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + num_extra)
            num_extra += 1
    return table


def byte_token_ids(tok: TextTokenizer, data: bytes) -> list[int]:
    """One single-byte vocabulary token per byte of `data` (splits multi-byte characters across tokens)."""
    table = bytes_to_unicode()
    ids = tok.hf_tokenizer.convert_tokens_to_ids([table[b] for b in data])
    assert tok.hf_tokenizer.unk_token_id not in ids, "the vocabulary lacks a single-byte token"
    return ids


def build_tiny_tokenizer_dir(path, words: list[str], generation_config: dict | None = None) -> str:
    """Save a word-level HF tokenizer (no chat template) to `path`; optionally a generation_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    hf.save_pretrained(str(path))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(path)

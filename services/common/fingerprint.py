"""A digest of a tokenizer that both services compute, so the tokenizer service can refuse a mismatched engine."""

import hashlib
import json
from typing import Any

_FINGERPRINT_HEX_CHARS = 16


def tokenizer_fingerprint(hf_tokenizer: Any) -> str:
    """A short stable hash of a transformers tokenizer: vocabulary, merges (or scores) and special tokens.

    Both services compute it over their own loaded tokenizer to check that they agree on the id space.
    """
    vocab = sorted(hf_tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    added = sorted((idx, tok.content, bool(tok.special)) for idx, tok in hf_tokenizer.added_tokens_decoder.items())
    special = sorted((key, str(value)) for key, value in hf_tokenizer.special_tokens_map.items())
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str())["model"] if backend is not None else {}
    payload = {
        "vocab": vocab,
        "added": added,
        "special": special,
        "model_type": model.get("type"),
        "merges": model.get("merges"),
        "scores": model.get("vocab") if model.get("type") == "Unigram" else None,
    }
    digest = hashlib.sha256(json.dumps(payload, ensure_ascii=True).encode("ascii")).hexdigest()
    return digest[:_FINGERPRINT_HEX_CHARS]

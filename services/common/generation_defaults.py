"""A model's sampling defaults: what fills the sampling fields a request leaves unset.

Each value comes from, in order: the checkpoint's generation_config.json; the model card's recommendation when
the checkpoint carries none (MODEL_CARD_SAMPLING, keyed by model name, so another model's GGUF never gets them);
the neutral value (sampling from the model's plain distribution). Like vLLM, `do_sample` is not read: a
generation config's sampling values apply as they are. A request's own values always win.

Shared by the tokenizer service (it resolves defaults for the engine and reports them in GetModelInfo) and the
offline LLM (generate() without sampling params). Pure Python: no transformers, torch or protobuf.
"""

import json
import os
from collections.abc import Mapping
from typing import Any

NEUTRAL_SAMPLING: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}

# The embedded SmolLM2-135M-Instruct GGUF has no generation config; at temperature 1 a 135M model rambles. Its
# model card's usage example generates with these (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct).
MODEL_CARD_SAMPLING: dict[str, dict[str, float | int]] = {
    "SmolLM2-135M-Instruct": {"temperature": 0.2, "top_p": 0.9},
}


def sampling_defaults(model_name: str, generation_config: Mapping[str, Any] | None) -> dict[str, float | int]:
    """Every key of NEUTRAL_SAMPLING, from the generation config (its non-null values), else the model card's
    values for `model_name`, else neutral."""
    card = MODEL_CARD_SAMPLING.get(model_name, {})
    config = generation_config or {}
    defaults: dict[str, float | int] = {}
    for key, neutral in NEUTRAL_SAMPLING.items():
        value = config.get(key)
        if value is None:
            value = card.get(key, neutral)
        defaults[key] = type(neutral)(value)
    return defaults


def read_generation_config(directory: str) -> dict[str, Any] | None:
    """The checkpoint directory's generation_config.json as a dict, or None when it has none (a GGUF)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as file:
        return json.load(file)

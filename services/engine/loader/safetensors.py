"""Hugging Face checkpoint directories: config.json (+ generation_config.json) and *.safetensors."""

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from services.engine.models.config import ModelConfig
from services.engine.models.registry import HF_ARCHITECTURES


def load_hf_config(model_dir: str) -> ModelConfig:
    """Read config.json (either the rope_theta/rope_scaling or the rope_parameters style)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    architecture = _architecture(raw)
    num_heads = raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}
    rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(model_dir, raw),
    )


def _architecture(raw: dict) -> str:
    for name in raw.get("architectures") or []:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    return raw.get("model_type", "")


def _eos_ids(model_dir: str, raw: dict) -> list[int]:
    ids = _as_list(raw.get("eos_token_id"))
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            ids += [i for i in _as_list(json.load(f).get("eos_token_id")) if i not in ids]
    return ids


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in the directory, as (name, CPU tensor)."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(os.path.join(model_dir, file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

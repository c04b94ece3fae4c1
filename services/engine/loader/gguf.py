"""GGUF files (llama.cpp): model config from the metadata, weights dequantized with the `gguf` package.

GGUF conventions undone here: llama.cpp tensor names, and the row permutation its converter applies to
Llama's q/k projections (it interleaves the two rotary halves of each head).
"""

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from services.engine.models.config import ModelConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Architectures whose llama.cpp converter permutes q/k rows.
_PERMUTED_QK = {"llama"}


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def load_gguf_config(reader: GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF with per-dimension rope_freqs (llama3-style scaling) is not supported")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=_field(reader, f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=_field(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=_field(reader, f"{arch}.attention.key_length", hidden // num_heads),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=_field(reader, f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=any(n.endswith("attn_q.bias") for n in tensor_names),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None for tensors we do not use."""
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, part, leaf = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{leaf}" if part in _LAYER_NAMES else None
    base, _, leaf = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{leaf}" if base in _GLOBAL_NAMES else None


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (pairs interleaved) -> (first half, second half)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_weights(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, fp32 tensor) for every tensor the model uses, dequantized and un-permuted."""
    permuted = config.architecture in _PERMUTED_QK
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        weight = dequantize(tensor.data, tensor.tensor_type)
        if permuted and name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, config.num_key_value_heads)
        if not weight.flags.writeable or not weight.flags.c_contiguous:
            weight = np.array(weight, copy=True)
        yield name, torch.from_numpy(weight)

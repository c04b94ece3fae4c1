"""`--quantization gguf`: the GGUF's Q4_1 projections as 4-bit values, scales and offsets read from the file's
bytes (never through fp32), for torch's int4 kernel (layers.quantization.Int4Weight).

A Q4_1 block is 20 bytes for 32 consecutive weights of a row: d (fp16), m (fp16), then 16 bytes of nibbles,
the low nibbles weights 0-15 and the high nibbles weights 16-31; w = d * q + m with q in 0..15.
"""

import numpy as np
from gguf import GGMLQuantizationType

from services.engine.loader.gguf import hf_name, unpermute_qk
from services.engine.models.config import ModelConfig

Q4_1_BLOCK, Q4_1_BYTES = 32, 20
# Hugging Face projection -> (our merged module, shard index); plain projections are their own module.
MERGED_SHARDS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
Q4Parts = tuple[np.ndarray, np.ndarray, np.ndarray]  # q uint8 [N, K], d fp32 [N, K/32], m fp32 [N, K/32]


def q4_1_parts(raw: np.ndarray, rows: int, cols: int) -> Q4Parts:
    """Q4_1 bytes (rows x cols/32 blocks) -> (q [rows, cols] in 0..15, d, m [rows, cols/32]): w = d * q + m."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // Q4_1_BLOCK, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]  # [rows, cols/32, 16]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return q, d, m


def gguf_q4_1_projections(reader, config: ModelConfig) -> dict[str, dict[int, Q4Parts]]:
    """Our module name -> {shard index: Q4 parts} for every Q4_1 projection weight of the file, with the
    llama.cpp q/k row permutation undone (on values, scales and offsets alike)."""
    permuted = config.architecture == "llama"
    projections: dict[str, dict[int, Q4Parts]] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or name is None or not name.endswith("_proj.weight"):
            continue
        cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest-varying dimension first
        parts = q4_1_parts(tensor.data, rows, cols)
        module_name = name.removesuffix(".weight")
        parent, _, proj = module_name.rpartition(".")
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(proj)
        if permuted and heads is not None:
            parts = tuple(unpermute_qk(part, heads) for part in parts)
        merged, index = MERGED_SHARDS.get(proj, (proj, 0))
        projections.setdefault(f"{parent}.{merged}", {})[index] = parts
    return projections

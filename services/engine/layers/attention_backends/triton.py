"""Paged attention with our Triton kernels (services/engine/kernels): the GPU backend without flash-attn."""

import torch

from services.engine.kernels.decode_attention import paged_decode_attention
from services.engine.kernels.paged_tile import interpreting
from services.engine.kernels.prefill_attention import prefill_attention
from services.engine.kernels.store_kv import store_kv
from services.engine.layers.attention_metadata import AttentionMetadata


class TritonBackend:
    """The AttentionBackend protocol on Triton kernels. No method waits on the device.

    Decode sizes its launch from the block table's capacity (block_tables.shape[1] * block_size), never
    from the current contexts, so a captured CUDA graph stays valid as contexts grow.
    """

    name = "triton"

    def __init__(self, decode_num_splits: int | None = None):
        self.decode_num_splits = decode_num_splits

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write k, v [N, Hkv, D] into the cache slots slot_mapping [N]; slots < 0 are skipped."""
        _check_device(k)
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of q [N, Hq, D]; reads the paged cache when meta.has_prefix, else k, v."""
        _check_device(q)
        max_seqlen_q = meta.max_seqlen_q or q.shape[0]
        if meta.has_prefix:
            return prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, max_seqlen_q,
                                     scale, block_tables=meta.block_tables)
        return prefill_attention(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, max_seqlen_q, scale)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One query per sequence, q [B, Hq, D], over meta.context_lens tokens of the paged cache."""
        _check_device(q)
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      num_splits=self.decode_num_splits)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not interpreting():
        raise RuntimeError("the triton attention backend needs a GPU (or TRITON_INTERPRET=1 set before "
                           "triton is imported); use the 'torch' backend on CPU")

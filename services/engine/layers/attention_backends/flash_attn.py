"""Paged attention with flash-attn 2.x (GPU only); K/V are stored with our Triton store_kv kernel.

flash-attn reads a paged cache only when its page (our cache block) holds a multiple of 256 tokens.
"""

import torch

from services.engine.kernels.store_kv import store_kv
from services.engine.layers.attention_metadata import AttentionMetadata

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError as exc:  # pragma: no cover - depends on the installation
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

FLASH_ATTN_PAGE_MULTIPLE = 256


def check_block_size(block_size: int) -> None:
    """Raise ValueError unless flash-attn can read a paged cache of this block size."""
    if block_size % FLASH_ATTN_PAGE_MULTIPLE:
        raise ValueError(f"the flash-attn backend needs a KV cache block size that is a multiple of "
                         f"{FLASH_ATTN_PAGE_MULTIPLE} (flash-attn's paged KV requirement), got {block_size}; "
                         f"use --block-size 256 or the 'triton' attention backend")


class FlashAttnBackend:
    """The AttentionBackend protocol on flash_attn_varlen_func (prefill) and flash_attn_with_kvcache (decode)."""

    name = "flash-attn"

    def __init__(self):
        if _IMPORT_ERROR is not None:
            raise ImportError("the flash-attn backend needs the flash-attn package (pip install "
                              "'llmserve[gpu]'); choose the 'triton' backend otherwise") from _IMPORT_ERROR

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write k, v [N, Hkv, D] into the cache slots slot_mapping [N]; slots < 0 are skipped."""
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Varlen causal attention (bottom-right aligned, so a cached prefix is seen in full)."""
        if meta.has_prefix:
            check_block_size(k_cache.shape[1])
            k, v = k_cache, v_cache
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale,
            causal=True, block_table=meta.block_tables if meta.has_prefix else None,
        )

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One query per sequence, q [B, Hq, D], over meta.context_lens tokens of the paged cache."""
        check_block_size(k_cache.shape[1])
        out = flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens, block_table=meta.block_tables,
            softmax_scale=scale, causal=True,
        )  # [B, 1, Hq, D]
        return out.squeeze(1)

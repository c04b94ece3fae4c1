"""The interface every attention backend implements (torch reference, Triton, flash-attn)."""

from typing import Protocol

import torch

from services.engine.layers.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Paged attention for one layer. Shapes: N new tokens, Hq query heads, Hkv KV heads, D head dim.

    k_cache, v_cache: [num_blocks, block_size, Hkv, D]. Hq is a multiple of Hkv (grouped-query).
    """

    name: str

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write k, v [N, Hkv, D] into the cache slots slot_mapping [N] (in place)."""
        ...

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of q [N, Hq, D] over each sequence's context; returns [N, Hq, D].

        k, v [N, Hkv, D] are the new tokens' keys and values (already stored in the cache). When
        meta.has_prefix, the cached prefix must be read from k_cache / v_cache through meta.block_tables.
        """
        ...

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One query token per sequence, q [B, Hq, D], over meta.context_lens tokens; returns [B, Hq, D]."""
        ...

"""Per-step attention inputs built by the model runner and read by every attention backend."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and which cached K/V each query attends to.

    KV cache of one layer: k_cache, v_cache each [num_blocks, block_size, num_kv_heads, head_dim].
    Slot s is block s // block_size, offset s % block_size.

    Prefill (variable-length batch of B sequences, N new tokens in all, flattened):
      cu_seqlens_q [B+1] int32: offsets of each sequence's new tokens in the flat batch.
      cu_seqlens_k [B+1] int32: offsets of each sequence's whole context (cached prefix + new tokens).
      max_seqlen_q, max_seqlen_k: the largest of each.
      block_tables [B, max_blocks] int32 (padded with 0), set when any sequence has a cached prefix
        (prefix-cache hit or an earlier chunk), so K/V must be read from the paged cache.
      New token i of sequence b sits at position context_len_b - seqlen_q_b + i and attends causally to
      every context position <= its own.
    Decode (B sequences, one new token each):
      context_lens [B] int32: tokens in each sequence's context including the new one.
      block_tables [B, max_blocks] int32 (padded with 0).
    Both: slot_mapping [N] int64, the cache slot of each new token.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # Host-side copies for backends that loop over sequences on the CPU (no device sync needed).
    seqlens_q_cpu: list[int] | None = None
    seqlens_k_cpu: list[int] | None = None

    @property
    def has_prefix(self) -> bool:
        return self.block_tables is not None

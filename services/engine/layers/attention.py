"""The attention layer: writes the new K/V into its paged cache and dispatches to a backend."""

import torch
from torch import nn

from services.engine.layers.attention_backends.base import AttentionBackend
from services.engine.layers.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged causal attention of one decoder layer.

    `k_cache` / `v_cache` ([num_blocks, block_size, Hkv, D]) are assigned by the model runner once the
    cache is allocated; until then they are empty and nothing is stored (e.g. a memory-profiling run).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        if backend is None:
            from services.engine.layers.attention_backends.torch_ref import TorchRefBackend

            backend = TorchRefBackend()
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq * D]."""
        has_cache = self.k_cache.numel() > 0
        if has_cache:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.is_prefill:
            out = self.backend.prefill(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        else:
            out = self.backend.decode(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

"""The CPU backend: the torch reference, with decode done by a compiled paged-attention kernel.

Decode is where the reference loses most on a CPU (it copies every context out of the paged cache);
the kernel reads the blocks in place. Anything the kernel does not cover (non-fp32) takes the torch path.
"""

import torch

from services.engine.kernels import cpu_decode_attention
from services.engine.layers.attention_backends.torch_ref import TorchRefBackend
from services.engine.layers.attention_metadata import AttentionMetadata


class CpuBackend(TorchRefBackend):
    name = "cpu"

    @staticmethod
    def available() -> bool:
        return cpu_decode_attention.load() is not None

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu":
            return super().decode(q, k_cache, v_cache, meta, scale)
        return cpu_decode_attention.paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                                           meta.context_lens, scale)

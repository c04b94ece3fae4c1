"""Paged KV cache: how many blocks fit, allocation, and binding per-layer views to the model."""

from dataclasses import dataclass

import torch

from services.engine.layers.attention import Attention

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(slots=True)
class GpuMemorySnapshot:
    """Device memory after a profiling forward at full batch size.

    used_bytes: total - free as the driver reports it (every process, our weights included).
    peak_bytes / current_bytes: torch's allocated peak during profiling and allocation now; the
    difference is the activation memory a real step needs on top of what is held now.
    """

    total_bytes: int
    used_bytes: int
    peak_bytes: int
    current_bytes: int


def kv_cache_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                         dtype_size: int) -> int:
    """Bytes of one block across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_size


def compute_num_kvcache_blocks(block_bytes: int, *, num_blocks: int | None = None,
                               memory_bytes: int | None = None, gpu: GpuMemorySnapshot | None = None,
                               gpu_memory_utilization: float = 0.9,
                               cpu_default_bytes: int = CPU_DEFAULT_KV_CACHE_BYTES) -> int:
    """Number of KV blocks: explicit count, else explicit bytes, else GPU headroom, else the CPU default.

    GPU headroom = total * utilization - used - (peak - current): what the utilization target leaves once
    everything in use now and the activations of a full step are accounted for.
    """
    if num_blocks is not None:
        result = num_blocks
    elif memory_bytes is not None:
        result = memory_bytes // block_bytes
    elif gpu is not None:
        budget = int(gpu.total_bytes * gpu_memory_utilization) - gpu.used_bytes - (gpu.peak_bytes - gpu.current_bytes)
        result = budget // block_bytes
    else:
        result = cpu_default_bytes // block_bytes
    if result < 1:
        raise ValueError(f"no room for a single KV cache block ({block_bytes} bytes); lower the model size, "
                         f"raise gpu_memory_utilization or pass num_kvcache_blocks")
    return result


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, Hkv, D], zeroed so padded reads never see NaNs."""
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def bind_kv_cache(layers: list[Attention], kv_cache: torch.Tensor) -> None:
    """Give each attention layer its views: layer i gets kv_cache[i, 0] (K) and kv_cache[i, 1] (V)."""
    if len(layers) != kv_cache.shape[0]:
        raise ValueError(f"{len(layers)} attention layers but a cache for {kv_cache.shape[0]}")
    for i, layer in enumerate(layers):
        layer.k_cache = kv_cache[i, 0]
        layer.v_cache = kv_cache[i, 1]

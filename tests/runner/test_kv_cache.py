"""KV cache sizing arithmetic, allocation and per-layer binding."""

import pytest
import torch

from services.engine.layers.attention import Attention
from services.engine.runner.kv_cache import (
    GpuMemorySnapshot, allocate_kv_cache, bind_kv_cache, compute_num_kvcache_blocks, kv_cache_block_bytes)

GIB = 1 << 30
SMOLLM2_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # K and V, 30 layers, 16 tokens, 3 KV heads, head_dim 64, fp32


def test_block_bytes_of_the_default_model():
    assert kv_cache_block_bytes(30, 16, 3, 64, 4) == SMOLLM2_BLOCK_BYTES
    assert kv_cache_block_bytes(30, 16, 3, 64, 2) == SMOLLM2_BLOCK_BYTES // 2


def test_explicit_block_count_wins_over_bytes():
    assert compute_num_kvcache_blocks(1000, num_blocks=7, memory_bytes=10**9) == 7


def test_explicit_bytes_round_down_to_whole_blocks():
    assert compute_num_kvcache_blocks(1000, memory_bytes=12_999) == 12


def test_cpu_default_is_one_gib_of_blocks():
    assert compute_num_kvcache_blocks(SMOLLM2_BLOCK_BYTES) == GIB // SMOLLM2_BLOCK_BYTES


def test_gpu_budget_subtracts_usage_and_activation_peak():
    gpu = GpuMemorySnapshot(total_bytes=100 * GIB, used_bytes=20 * GIB, peak_bytes=12 * GIB, current_bytes=10 * GIB)
    # 100 * 0.9 - 20 in use - (12 - 10) of activations = 68 GiB
    assert compute_num_kvcache_blocks(GIB // 4, gpu=gpu, gpu_memory_utilization=0.9) == 68 * 4
    assert compute_num_kvcache_blocks(GIB // 4, gpu=gpu, gpu_memory_utilization=0.5) == 28 * 4


def test_no_room_for_a_block_raises():
    gpu = GpuMemorySnapshot(total_bytes=10 * GIB, used_bytes=9 * GIB, peak_bytes=GIB, current_bytes=0)
    with pytest.raises(ValueError, match="KV cache block"):
        compute_num_kvcache_blocks(1000, gpu=gpu, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError):
        compute_num_kvcache_blocks(1000, memory_bytes=999)


def test_layers_get_views_of_one_zeroed_tensor():
    cache = allocate_kv_cache(3, 5, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert cache.shape == (3, 2, 5, 4, 2, 8) and not cache.any()
    layers = [Attention(4, 2, 8, 8 ** -0.5) for _ in range(3)]
    bind_kv_cache(layers, cache)
    layers[1].k_cache[2, 3] = 1.0
    layers[2].v_cache[0, 0, 1] = 2.0
    assert cache[1, 0, 2, 3].eq(1.0).all() and cache[2, 1, 0, 0, 1].eq(2.0).all()
    assert cache.count_nonzero() == 2 * 8 + 8
    with pytest.raises(ValueError):
        bind_kv_cache(layers[:2], cache)

"""store_kv: the Triton kernel against its torch reference and a plain per-token loop."""

import pytest
import torch

from services.engine.kernels.store_kv import store_kv, store_kv_reference
from tests.kernels.helpers import randn

NUM_BLOCKS = 6


def _caches(block_size, num_kv_heads, head_dim, dtype, device, gen):
    k_cache = randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, gen=gen, device=device, dtype=dtype)
    v_cache = randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, gen=gen, device=device, dtype=dtype)
    return k_cache, v_cache


def _slots(num_tokens, block_size, gen, device):
    """Distinct slots in shuffled order, with one padded row (-1) in the middle."""
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1
    return slots.to(device=device, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size, num_kv_heads, head_dim", [(16, 3, 64), (8, 2, 96), (8, 1, 128)])
def test_store_kv_matches_reference(device, dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    num_tokens = 11
    k = randn(num_tokens, num_kv_heads, head_dim, gen=gen, device=device, dtype=dtype)
    v = randn(num_tokens, num_kv_heads, head_dim, gen=gen, device=device, dtype=dtype)
    k_cache, v_cache = _caches(block_size, num_kv_heads, head_dim, dtype, device, gen)
    slots = _slots(num_tokens, block_size, gen, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_reference(k, v, k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_reference_matches_per_token_loop(device):
    gen = torch.Generator().manual_seed(1)
    block_size, num_tokens = 8, 9
    k = randn(num_tokens, 3, 64, gen=gen, device=device)
    v = randn(num_tokens, 3, 64, gen=gen, device=device)
    k_cache, v_cache = _caches(block_size, 3, 64, torch.float32, device, gen)
    slots = _slots(num_tokens, block_size, gen, device)
    k_before, k_loop, v_loop = k_cache.clone(), k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_loop[slot // block_size, slot % block_size] = k[i]
            v_loop[slot // block_size, slot % block_size] = v[i]

    store_kv_reference(k, v, k_cache, v_cache, slots)

    assert torch.equal(k_cache, k_loop)
    assert torch.equal(v_cache, v_loop)
    assert not torch.equal(k_cache, k_before)


def test_padded_slot_writes_nothing(device):
    gen = torch.Generator().manual_seed(2)
    k = randn(3, 3, 64, gen=gen, device=device)
    v = randn(3, 3, 64, gen=gen, device=device)
    k_cache, v_cache = _caches(16, 3, 64, torch.float32, device, gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()

    store_kv(k, v, k_cache, v_cache, torch.tensor([-1, -1, -1], dtype=torch.int64, device=device))

    assert torch.equal(k_cache, before_k)
    assert torch.equal(v_cache, before_v)


def test_strided_views_of_a_fused_qkv(device):
    """k and v sliced out of one [N, (Hq + 2 Hkv) * D] projection, as the model produces them."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_q_heads, num_kv_heads, head_dim, block_size = 7, 9, 3, 64, 16
    qkv = randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, gen=gen, device=device)
    _, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    k_cache, v_cache = _caches(block_size, num_kv_heads, head_dim, torch.float32, device, gen)
    slots = _slots(num_tokens, block_size, gen, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_reference(k.contiguous(), v.contiguous(), k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)

"""Paged decode attention: the Triton kernel against its torch reference, the reference against dense attention."""

import pytest
import torch

from services.engine.kernels import decode_attention
from services.engine.kernels.decode_attention import (
    choose_num_splits,
    plan_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from tests.kernels.helpers import ATOL, RTOL, dense_attention, paged_kv, randn

CONTEXT_LENS = [1, 17, 70, 33]  # block-misaligned, one a single token


def _decode_case(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, device, seed=0,
                 dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    keys = [randn(n, num_kv_heads, head_dim, gen=gen, device=device, dtype=dtype) for n in context_lens]
    values = [randn(n, num_kv_heads, head_dim, gen=gen, device=device, dtype=dtype) for n in context_lens]
    k_cache, v_cache, block_tables = paged_kv(keys, values, block_size, gen)
    q = randn(len(context_lens), num_q_heads, head_dim, gen=gen, device=device, dtype=dtype)
    context_lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, keys, values, k_cache, v_cache, block_tables, context_lens


def test_reference_matches_dense_attention(device):
    q, keys, values, k_cache, v_cache, block_tables, context_lens = _decode_case(CONTEXT_LENS, 8, 2, 64, 8, device)
    scale = 64 ** -0.5

    out = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)

    for b in range(len(keys)):
        expected = dense_attention(q[b:b + 1], keys[b], values[b], scale)[0]
        torch.testing.assert_close(out[b].double().cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(3, 3), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (96, 8)])
def test_kernel_matches_reference(device, num_q_heads, num_kv_heads, head_dim, block_size):
    q, _, _, k_cache, v_cache, block_tables, context_lens = _decode_case(
        CONTEXT_LENS, num_q_heads, num_kv_heads, head_dim, block_size, device)
    scale = head_dim ** -0.5

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, block_n=16)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)

    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [2, 3, 6])
def test_several_splits(device, num_splits):
    """Split-K partials merged by the reduce kernel. The block tables hold 96 tokens; 6 splits of 16 leave
    the 1- and 17-token rows with empty splits."""
    q, _, _, k_cache, v_cache, block_tables, context_lens = _decode_case(CONTEXT_LENS, 9, 3, 64, 16, device, seed=1)
    scale = 0.125

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits,
                                 block_n=16)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)

    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_default_launch_and_tight_max_context(device):
    q, _, _, k_cache, v_cache, block_tables, context_lens = _decode_case(CONTEXT_LENS, 8, 2, 80, 16, device, seed=2)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, 0.1)

    for max_context_len in (None, max(CONTEXT_LENS)):
        out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.1,
                                     max_context_len=max_context_len)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_context_yields_zeros(device, num_splits):
    """A padded decode row (context length 0) gives zeros, not NaN, and leaves the others intact."""
    q, _, _, k_cache, v_cache, block_tables, context_lens = _decode_case([20, 40], 4, 2, 64, 8, device, seed=3)
    context_lens[0] = 0

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.125, num_splits=num_splits,
                                 block_n=16)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, 0.125)

    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    q, _, _, k_cache, v_cache, block_tables, context_lens = _decode_case(
        CONTEXT_LENS, 9, 3, 64, 16, device, seed=4, dtype=dtype)

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.125, num_splits=2, block_n=16)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, 0.125)

    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_choose_num_splits_fills_the_device_only_when_needed(monkeypatch):
    monkeypatch.setattr(decode_attention, "_target_programs", lambda device: 264)
    cuda = torch.device("cuda")
    assert choose_num_splits(batch=256, num_kv_heads=8, max_context_len=1024, block_n=64, device=cuda) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context_len=32768, block_n=64, device=cuda) == 33
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context_len=128, block_n=64, device=cuda) == 1
    assert choose_num_splits(batch=1, num_kv_heads=1, max_context_len=1 << 20, block_n=64,
                             device=cuda) == decode_attention.MAX_SPLITS


def test_plan_splits_rounds_to_tiles_and_drops_empty_splits():
    cpu = torch.device("cpu")
    assert plan_splits(1, 1, 96, 16, cpu, num_splits=6) == (6, 16)
    assert plan_splits(1, 1, 96, 16, cpu, num_splits=5) == (3, 32)  # 20 tokens round up to 2 tiles
    assert plan_splits(1, 1, 32, 64, cpu, num_splits=2) == (2, 16)  # shorter than a tile: 16-token granule
    assert plan_splits(1, 1, 1000, 64, cpu, num_splits=1) == (1, 1024)


def test_mismatched_heads_raise(device):
    q = torch.ones(1, 5, 64, device=device)
    cache = torch.ones(2, 16, 2, 64, device=device)
    with pytest.raises(ValueError):
        paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32, device=device),
                               torch.ones(1, dtype=torch.int32, device=device), 0.1)

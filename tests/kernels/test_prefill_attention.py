"""Varlen prefill attention: the Triton kernel against its torch reference, the reference against dense attention."""

import pytest
import torch

from services.engine.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from tests.kernels.helpers import ATOL, RTOL, dense_attention, paged_kv, randn

# (new tokens, context length): a block-aligned prefix hit, no prefix, a misaligned chunk, one token.
SEQS = [(5, 37), (13, 13), (20, 70), (1, 9)]


def _prefill_case(seqs, num_q_heads, num_kv_heads, head_dim, block_size, device, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    keys = [randn(ctx, num_kv_heads, head_dim, gen=gen, device=device, dtype=dtype) for _, ctx in seqs]
    values = [randn(ctx, num_kv_heads, head_dim, gen=gen, device=device, dtype=dtype) for _, ctx in seqs]
    k_cache, v_cache, block_tables = paged_kv(keys, values, block_size, gen)
    q = randn(sum(n for n, _ in seqs), num_q_heads, head_dim, gen=gen, device=device, dtype=dtype)
    cu_q = _cumulative([n for n, _ in seqs], device)
    cu_k = _cumulative([ctx for _, ctx in seqs], device)
    return q, keys, values, k_cache, v_cache, block_tables, cu_q, cu_k


def _cumulative(lengths, device):
    return torch.tensor([0] + lengths).cumsum(0).to(device=device, dtype=torch.int32)


def _max_q(seqs):
    return max(n for n, _ in seqs)


def test_reference_matches_dense_attention(device):
    q, keys, values, k_cache, v_cache, block_tables, cu_q, cu_k = _prefill_case(SEQS, 8, 2, 64, 8, device)
    scale = 0.125

    out = prefill_attention_reference(q, k_cache, v_cache, cu_q, cu_k, scale, block_tables=block_tables)

    for b, (q_lo, q_hi) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
        expected = dense_attention(q[q_lo:q_hi], keys[b], values[b], scale)
        torch.testing.assert_close(out[q_lo:q_hi].double().cpu(), expected, atol=1e-5, rtol=1e-5)


def test_flat_reference_matches_dense_attention(device):
    seqs = [(n, n) for n, _ in SEQS]
    q, keys, values, *_, cu, _ = _prefill_case(seqs, 9, 3, 64, 16, device, seed=1)

    out = prefill_attention_reference(q, torch.cat(keys), torch.cat(values), cu, cu, 0.125)

    for b, (lo, hi) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        expected = dense_attention(q[lo:hi], keys[b], values[b], 0.125)
        torch.testing.assert_close(out[lo:hi].double().cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(3, 3), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (96, 8)])
def test_paged_kernel_matches_reference(device, num_q_heads, num_kv_heads, head_dim, block_size):
    q, _, _, k_cache, v_cache, block_tables, cu_q, cu_k = _prefill_case(
        SEQS, num_q_heads, num_kv_heads, head_dim, block_size, device)
    scale = head_dim ** -0.5

    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, _max_q(SEQS), scale, block_tables=block_tables,
                            block_m=16, block_n=16)
    ref = prefill_attention_reference(q, k_cache, v_cache, cu_q, cu_k, scale, block_tables=block_tables)

    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16)])
def test_tile_shapes_around_the_diagonal(device, block_m, block_n):
    """Unequal tiles move the split between unmasked and diagonal tiles; the result must not change."""
    q, _, _, k_cache, v_cache, block_tables, cu_q, cu_k = _prefill_case(SEQS, 4, 2, 64, 16, device, seed=2)

    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, _max_q(SEQS), 0.125, block_tables=block_tables,
                            block_m=block_m, block_n=block_n)
    ref = prefill_attention_reference(q, k_cache, v_cache, cu_q, cu_k, 0.125, block_tables=block_tables)

    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 1, 80)])
def test_flat_kernel_matches_reference(device, num_q_heads, num_kv_heads, head_dim):
    """No cached prefix: K/V come straight from the new tokens' flat tensors."""
    seqs = [(n, n) for n, _ in SEQS]
    gen = torch.Generator().manual_seed(3)
    num_tokens = sum(n for n, _ in seqs)
    q = randn(num_tokens, num_q_heads, head_dim, gen=gen, device=device)
    k = randn(num_tokens, num_kv_heads, head_dim, gen=gen, device=device)
    v = randn(num_tokens, num_kv_heads, head_dim, gen=gen, device=device)
    cu = _cumulative([n for n, _ in seqs], device)

    out = prefill_attention(q, k, v, cu, cu, _max_q(seqs), 0.1, block_m=16, block_n=16)
    ref = prefill_attention_reference(q, k, v, cu, cu, 0.1)

    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_default_tiles_and_loose_max_seqlen(device):
    """GPU-sized tiles, and max_seqlen_q larger than needed (extra query blocks must exit cleanly)."""
    q, _, _, k_cache, v_cache, block_tables, cu_q, cu_k = _prefill_case(SEQS, 9, 3, 64, 16, device, seed=4)

    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, q.shape[0], 0.125, block_tables=block_tables)
    ref = prefill_attention_reference(q, k_cache, v_cache, cu_q, cu_k, 0.125, block_tables=block_tables)

    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    q, _, _, k_cache, v_cache, block_tables, cu_q, cu_k = _prefill_case(SEQS, 9, 3, 64, 16, device, seed=5,
                                                                        dtype=dtype)

    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, _max_q(SEQS), 0.125, block_tables=block_tables,
                            block_m=16, block_n=16)
    ref = prefill_attention_reference(q, k_cache, v_cache, cu_q, cu_k, 0.125, block_tables=block_tables)

    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)

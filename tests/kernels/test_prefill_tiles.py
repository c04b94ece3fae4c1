"""Prefill tile sizes by dtype and head dim: fp32 at head dims 80-128 must not get the 64x64 tiles that
spilled to local memory on the GPU; the kernel with the chosen tiles matches the torch reference."""

import pytest
import torch

from services.engine.kernels.prefill_attention import (
    MIN_TILE, TILE_BUDGET_BYTES, _tile_bytes, launch_prefill, prefill_attention, prefill_attention_reference,
    prefill_tiles)
from tests.kernels.helpers import ATOL, RTOL, randn
from tests.kernels.test_prefill_attention import SEQS, _cumulative, _max_q, _prefill_case

HALF = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("head_dim", [80, 96, 112, 128])
def test_fp32_gets_smaller_tiles_at_head_dims_80_to_128(head_dim):
    assert prefill_tiles(torch.float32, head_dim) == (32, 32)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.float32, 32), *[(d, 128) for d in HALF],
                                             *[(d, 64) for d in HALF]])
def test_the_tiles_that_fit_stay_64x64(dtype, head_dim):
    assert prefill_tiles(dtype, head_dim) == (64, 64)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_every_head_dim_gets_power_of_two_tiles_within_the_budget(dtype):
    elem_bytes = torch.finfo(dtype).bits // 8
    previous = (64, 64)
    for head_dim in range(8, 257, 8):
        block_m, block_n = prefill_tiles(dtype, head_dim)
        assert {block_m, block_n} <= {16, 32, 64}, head_dim
        dim_pad = max(16, 1 << (head_dim - 1).bit_length())
        assert _tile_bytes(block_m, block_n, dim_pad, elem_bytes) <= TILE_BUDGET_BYTES or block_m == MIN_TILE
        assert block_m * block_n <= previous[0] * previous[1], "a larger head dim never gets larger tiles"
        previous = (block_m, block_n)


@pytest.mark.parametrize("head_dim", [80, 96, 128])
def test_fp32_paged_kernel_with_default_tiles_matches_reference(device, head_dim):
    q, _, _, k_cache, v_cache, block_tables, cu_q, cu_k = _prefill_case(SEQS, 4, 2, head_dim, 16, device, seed=6)
    scale = head_dim ** -0.5

    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, _max_q(SEQS), scale, block_tables=block_tables)
    ref = prefill_attention_reference(q, k_cache, v_cache, cu_q, cu_k, scale, block_tables=block_tables)

    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("head_dim", [80, 128])
def test_fp32_flat_kernel_with_default_tiles_matches_reference(device, head_dim):
    """Whole prompts longer than one 32-row tile, so several query blocks and diagonal tiles run."""
    lengths = [70, 33, 5]
    gen = torch.Generator().manual_seed(7)
    q, k, v = (randn(sum(lengths), heads, head_dim, gen=gen, device=device) for heads in (6, 3, 3))
    cu = _cumulative(lengths, device)

    out = prefill_attention(q, k, v, cu, cu, max(lengths), head_dim ** -0.5)
    ref = prefill_attention_reference(q, k, v, cu, cu, head_dim ** -0.5)

    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_default_tiles_do_not_spill_on_the_gpu(device, dtype, head_dim):
    if device.type != "cuda":
        pytest.skip("register spills are a property of the GPU build")
    q, _, _, k_cache, v_cache, block_tables, cu_q, cu_k = _prefill_case(SEQS, 4, 2, head_dim, 16, device, dtype=dtype)
    out = torch.empty_like(q)

    kernel = launch_prefill(out, q, k_cache, v_cache, cu_q, cu_k, _max_q(SEQS), 0.1, block_tables=block_tables)

    assert kernel.n_spills == 0, f"{prefill_tiles(dtype, head_dim)} tiles: {kernel.n_regs} registers, spills"

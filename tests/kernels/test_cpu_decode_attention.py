"""The compiled CPU decode kernel against the torch reference and a naive dense attention."""

import pytest
import torch

from services.engine.kernels import cpu_decode_attention
from services.engine.kernels.decode_attention import paged_decode_attention_reference
from services.engine.layers.attention_backends.cpu import CpuBackend
from services.engine.layers.attention_metadata import AttentionMetadata
from tests.kernels.helpers import ATOL, RTOL, paged_layout, randn, scatter_to_cache

pytestmark = pytest.mark.skipif(cpu_decode_attention.load() is None, reason="no C++ toolchain to build the kernel")


def _case(context_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cpu = torch.device("cpu")
    num_blocks, block_tables = paged_layout(context_lens, block_size, gen)
    keys = [randn(n, num_kv_heads, head_dim, gen=gen, device=cpu) for n in context_lens]
    values = [randn(n, num_kv_heads, head_dim, gen=gen, device=cpu) for n in context_lens]
    k_cache = scatter_to_cache(keys, block_tables, num_blocks, block_size, gen)
    v_cache = scatter_to_cache(values, block_tables, num_blocks, block_size, gen)
    q = randn(len(context_lens), num_heads, head_dim, gen=gen, device=cpu)
    return q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32), keys, values


def _dense(q, keys, values, scale):
    """Naive attention of each row's single query over its own unpaged context."""
    rows = []
    for b, (k, v) in enumerate(zip(keys, values)):
        group = q.shape[1] // k.shape[1]
        k_full = k.repeat_interleave(group, dim=1).double()  # [L, Hq, D]
        v_full = v.repeat_interleave(group, dim=1).double()
        scores = torch.einsum("hd,lhd->hl", q[b].double(), k_full) * scale
        rows.append(torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v_full).float())
    return torch.stack(rows)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 96), (12, 3, 80)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_kernel_matches_reference_and_dense(num_heads, num_kv_heads, head_dim, block_size):
    q, k_cache, v_cache, tables, lens, keys, values = _case([1, 17, 40, 33], num_heads, num_kv_heads,
                                                           head_dim, block_size)
    scale = head_dim ** -0.5
    out = cpu_decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    reference = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out, reference, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out, _dense(q, keys, values, scale), atol=ATOL, rtol=RTOL)


def test_empty_context_row_gives_zeros_and_leaves_others_intact():
    q, k_cache, v_cache, tables, lens, keys, values = _case([5, 24], 6, 3, 64, 16, seed=1)
    lens[0] = 0
    out = cpu_decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.count_nonzero(out[0]) == 0
    torch.testing.assert_close(out[1:], _dense(q[1:], keys[1:], values[1:], 0.125), atol=ATOL, rtol=RTOL)


def test_backend_decode_uses_kernel_for_fp32_and_matches_torch_path(monkeypatch):
    q, k_cache, v_cache, tables, lens, *_ = _case([3, 50, 21], 9, 3, 64, 16, seed=2)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(3, dtype=torch.int64),
                             block_tables=tables, context_lens=lens, seqlens_k_cpu=lens.tolist())
    kernel_calls = []
    kernel = cpu_decode_attention.paged_decode_attention
    monkeypatch.setattr(cpu_decode_attention, "paged_decode_attention",
                        lambda *args: kernel_calls.append(args[0].dtype) or kernel(*args))
    backend = CpuBackend()
    fast = backend.decode(q, k_cache, v_cache, meta, 0.125)
    assert kernel_calls == [torch.float32], "the fp32 decode did not run the compiled kernel"
    slow = super(CpuBackend, backend).decode(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(fast, slow, atol=ATOL, rtol=RTOL)
    backend.decode(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.125)
    assert kernel_calls == [torch.float32], "bf16 must take the torch path"

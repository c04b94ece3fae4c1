"""Triton building blocks shared by the attention kernels: a K/V tile load and one online-softmax step."""

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(base_ptr, block_table_row, pos, mask_n, kv_head, offs_d, mask_d,
                 stride_block, stride_slot, stride_head, stride_dim, block_size,
                 PAGED: tl.constexpr):
    """Load K or V rows at context positions pos [BLOCK_N] of one KV head → [BLOCK_N, DIM_PAD].

    PAGED: base_ptr is a cache [num_blocks, block_size, Hkv, D] read through block_table_row.
    Otherwise base_ptr already points at the sequence's first token of a flat [N, Hkv, D] tensor
    (stride_slot is its token stride, stride_block unused).
    """
    if PAGED:
        block_ids = tl.load(block_table_row + pos // block_size, mask=mask_n, other=0).to(tl.int64)
        row_off = block_ids * stride_block + (pos % block_size).to(tl.int64) * stride_slot
    else:
        row_off = pos.to(tl.int64) * stride_slot
    ptrs = base_ptr + row_off[:, None] + kv_head * stride_head + offs_d[None, :] * stride_dim
    return tl.load(ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, mask,
                        MASKED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one K/V tile into the running (max, sum, acc) of rows q [M, DIM_PAD] (log2 domain).

    mask [M, BLOCK_N] is applied only when MASKED; every row must see at least one key over the
    whole loop before its first fully-masked tile (true for causal attention starting at key 0).
    """
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N]
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def dot_options(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_FP32, DOT_PRECISION) for inputs of dtype.

    fp32 uses exact ("ieee") products instead of tf32. The Triton interpreter multiplies bf16 tiles
    as raw uint16 bit patterns (triton 3.9), so there bf16 tiles are upcast to fp32 before tl.dot.
    """
    upcast = interpreting() and dtype == torch.bfloat16
    return upcast, "ieee" if dtype == torch.float32 or upcast else "tf32"


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET, read at decoration time)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

"""Variable-length causal prefill attention over a paged (or flat) context (Triton), beside its torch reference.

One program per (query block, query head, sequence). Query i of sequence b sits at context position
context_len_b - seqlen_q_b + i and sees every key at or before it: the cached prefix in full, the new
tokens causally. Keys below the block's first query position need no mask; only the tiles crossing
the diagonal are masked.
"""

import torch
import triton
import triton.language as tl

from services.engine.kernels.paged_tile import LOG2E, dot_options, load_kv_tile, online_softmax_step

# What one program may hold in registers (by _tile_bytes' count): 4 warps have 128 threads x 255 32-bit
# registers, ~128 KiB, of which addresses, masks and loop state take a share. Calibrated on the GPU check's
# review: 64x64 tiles compiled without spilling in bf16 at head dim 128 (104 KiB by this count) and in fp32
# at 64 (96 KiB), and spilled to local memory in fp32 at head dims 80-128 (160 KiB).
TILE_BUDGET_BYTES = 104 * 1024
MAX_TILE, MIN_TILE = 64, 16  # tl.dot needs every dimension >= 16


def _tile_bytes(block_m: int, block_n: int, dim_pad: int, elem_bytes: int) -> int:
    """Bytes of the tiles a program keeps live: q [M, D] and the fp32 acc [M, D], K and V [N, D], the fp32
    scores and their probabilities [M, N] (cast to V's type for the second product)."""
    rows = block_m * dim_pad * (elem_bytes + 4) + 2 * block_n * dim_pad * elem_bytes
    return rows + block_m * block_n * (4 + elem_bytes)


def prefill_tiles(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for prefill_attention: 64x64, halved (BLOCK_N first, then alternately) until the
    tiles fit TILE_BUDGET_BYTES. fp32 (exact products, 4-byte tiles) at head dims 65-128 gets 32x32; bf16 and
    fp16 keep 64x64 up to head dim 128."""
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    elem_bytes = torch.finfo(dtype).bits // 8
    block_m = block_n = MAX_TILE
    while _tile_bytes(block_m, block_n, dim_pad, elem_bytes) > TILE_BUDGET_BYTES and block_m > MIN_TILE:
        if block_n >= block_m and block_n > MIN_TILE:
            block_n //= 2
        else:
            block_m //= 2
    return block_m, block_n


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, block_tables_ptr,
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od, stride_bt,
    qk_scale, block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    context_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    prefix_len = context_len - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DIM_PAD)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, DIM_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = prefix_len + offs_m  # [BLOCK_M]

    if PAGED:
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_ptr
        v_base = v_ptr
    else:
        bt_row = block_tables_ptr
        k_base = k_ptr + k_start.to(tl.int64) * stride_ks
        v_base = v_ptr + k_start.to(tl.int64) * stride_vs

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    # Phase 1: whole tiles every row of this block sees.
    full_end = (prefix_len + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
    for tile_start in range(0, full_end, BLOCK_N):
        pos = tile_start + offs_n
        mask_n = pos < full_end
        k = load_kv_tile(k_base, bt_row, pos, mask_n, kv_head, offs_d, mask_d,
                         stride_kb, stride_ks, stride_kh, stride_kd, block_size, PAGED=PAGED)
        v = load_kv_tile(v_base, bt_row, pos, mask_n, kv_head, offs_d, mask_d,
                         stride_vb, stride_vs, stride_vh, stride_vd, block_size, PAGED=PAGED)
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, mask_n[None, :], MASKED=False,
                                            DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)
    # Phase 2: tiles crossing the causal diagonal, up to the block's last query position.
    hi = tl.minimum(context_len, prefix_len + (m_block + 1) * BLOCK_M)
    for tile_start in range(full_end, hi, BLOCK_N):
        pos = tile_start + offs_n
        mask_n = pos < hi
        k = load_kv_tile(k_base, bt_row, pos, mask_n, kv_head, offs_d, mask_d,
                         stride_kb, stride_ks, stride_kh, stride_kd, block_size, PAGED=PAGED)
        v = load_kv_tile(v_base, bt_row, pos, mask_n, kv_head, offs_d, mask_d,
                         stride_vb, stride_vs, stride_vh, stride_vd, block_size, PAGED=PAGED)
        visible = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, visible, MASKED=True,
                                            DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + head * stride_oh + offs_d[None, :] * stride_od, out,
             mask=mask_m[:, None] & mask_d[None, :])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, scale: float,
                      block_tables: torch.Tensor | None = None, block_m: int | None = None,
                      block_n: int | None = None) -> torch.Tensor:
    """Causal attention of the flat new tokens q [N, Hq, D] over each sequence's context → [N, Hq, D].

    With block_tables [B, max_blocks] int32, k and v are the paged caches [num_blocks, block_size, Hkv, D]
    (holding the prefix and the new tokens); without, they are the new tokens' flat k, v [N, Hkv, D] and
    cu_seqlens_k must equal cu_seqlens_q. cu_seqlens_* [B+1] int32; max_seqlen_q is a host int. Tiles
    default to prefill_tiles(q.dtype, D).
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [N, Hq, D]
    launch_prefill(out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, block_tables, block_m, block_n)
    return out


def launch_prefill(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, scale: float,
                   block_tables: torch.Tensor | None = None, block_m: int | None = None,
                   block_n: int | None = None):
    """prefill_attention into `out` [N, Hq, D]. Returns Triton's compiled kernel on a GPU (its n_regs and
    n_spills tell whether the tiles fit in registers); None under the interpreter or when nothing ran."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    if num_q_heads % num_kv_heads or k.shape[-1] != head_dim:
        raise ValueError(f"q heads {num_q_heads} x {head_dim} do not fit K's {num_kv_heads} x {k.shape[-1]}")
    batch = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or batch == 0:
        return None
    default_m, default_n = prefill_tiles(q.dtype, head_dim)
    block_m, block_n = block_m or default_m, block_n or default_n
    paged = block_tables is not None
    if paged:
        k_strides, v_strides = k.stride(), v.stride()
        block_size, bt, stride_bt = k.shape[1], block_tables, block_tables.stride(0)
    else:
        k_strides, v_strides = (0, *k.stride()), (0, *v.stride())
        block_size, bt, stride_bt = 1, cu_seqlens_k, 0
    dot_fp32, dot_precision = dot_options(q.dtype)
    grid = (triton.cdiv(max_seqlen_q, block_m), num_q_heads, batch)
    return _prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, bt,
        *q.stride(), *k_strides, *v_strides, *out.stride(), stride_bt,
        scale * LOG2E, block_size,
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, PAGED=paged, DOT_FP32=dot_fp32, DOT_PRECISION=dot_precision,
    )


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float,
                                block_tables: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch prefill with prefill_attention's contract: per sequence, gather the context (through
    the block table when given), dense causal-offset mask, softmax in fp32."""
    num_q_heads, num_kv_heads = q.shape[1], k.shape[-2]
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        q_lo, q_hi = bounds_q[b], bounds_q[b + 1]
        context_len = bounds_k[b + 1] - bounds_k[b]
        if block_tables is not None:
            positions = torch.arange(context_len, device=q.device)
            blocks = block_tables[b].long()[positions // k.shape[1]]
            keys, values = k[blocks, positions % k.shape[1]], v[blocks, positions % k.shape[1]]
        else:
            keys, values = k[bounds_k[b]:bounds_k[b + 1]], v[bounds_k[b]:bounds_k[b + 1]]
        keys = keys.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = values.float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(context_len - (q_hi - q_lo), context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]  # [Lq, L]
        scores = torch.einsum("qhd,lhd->hql", q[q_lo:q_hi].float(), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q_lo:q_hi] = torch.einsum("hql,lhd->qhd", scores.softmax(dim=-1), values)
    return out.to(q.dtype)

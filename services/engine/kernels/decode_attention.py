"""Paged decode attention (Triton, split-K "flash-decoding"), beside its torch reference.

One program per (sequence, KV head, split) loads each K/V tile once and scores every query head of
that grouped-query group with one tl.dot (the group is padded to 16 rows, the smallest dot shape).
With several splits each program writes a partial (max, sum, acc) and a second kernel merges them.
"""

import functools

import torch
import triton
import triton.language as tl

from services.engine.kernels.paged_tile import LOG2E, dot_options, load_kv_tile, online_softmax_step

MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_ob, stride_oh, stride_od,
    stride_pb, stride_ph, stride_ps,
    qk_scale, block_size, split_len,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD]
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_gd = mask_g[:, None] & mask_d[None, :]
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_gd, other=0.0)  # [GROUP_PAD, DIM_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        mask_n = pos < end
        k = load_kv_tile(k_cache_ptr, bt_row, pos, mask_n, kv_head, offs_d, mask_d,
                         stride_kb, stride_ks, stride_kh, stride_kd, block_size, PAGED=True)
        v = load_kv_tile(v_cache_ptr, bt_row, pos, mask_n, kv_head, offs_d, mask_d,
                         stride_vb, stride_vs, stride_vh, stride_vd, block_size, PAGED=True)
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, mask_n[None, :], MASKED=True,
                                            DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)

    if SINGLE_SPLIT:
        # NOTE: an empty context (padded row) has l_i == 0 and acc == 0; it yields zeros, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out, mask=mask_gd)
    else:
        p_off = seq.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps  # [GROUP_PAD]
        tl.store(part_max_ptr + p_off, m_i, mask=mask_g)
        tl.store(part_sum_ptr + p_off, l_i, mask=mask_g)
        tl.store(part_acc_ptr + p_off[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_gd)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_ob, stride_oh, stride_od, stride_pb, stride_ph, stride_ps,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    p_off = seq * stride_pb + head * stride_ph + offs_s * stride_ps  # [SPLITS_PAD]
    m = tl.load(part_max_ptr + p_off, mask=mask_s, other=float("-inf"))
    l = tl.load(part_sum_ptr + p_off, mask=mask_s, other=0.0)
    acc = tl.load(part_acc_ptr + p_off[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [SPLITS_PAD, DIM_PAD]
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od, out, mask=mask_d)


@functools.lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, block_n: int,
                      device: torch.device) -> int:
    """Splits per sequence: enough programs to fill the device, each split at least a few tiles long."""
    num_tiles = max(1, triton.cdiv(max_context_len, block_n))
    wanted = triton.cdiv(_target_programs(device), batch * num_kv_heads)
    by_work = triton.cdiv(num_tiles, MIN_TILES_PER_SPLIT)
    return max(1, min(wanted, by_work, MAX_SPLITS))


def plan_splits(batch: int, num_kv_heads: int, max_context_len: int, block_n: int, device: torch.device,
                num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, split_len) of a launch: a requested or chosen split count, then whole tiles per split
    (a multiple of 16 tokens when a split is shorter than one tile), then no split left empty by design."""
    max_context_len = max(1, max_context_len)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, block_n, device)
    split_len = triton.cdiv(max_context_len, num_splits)
    granule = block_n if split_len >= block_n else 16
    split_len = triton.cdiv(split_len, granule) * granule
    return triton.cdiv(max_context_len, split_len), split_len


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context_len: int | None = None, num_splits: int | None = None,
                           block_n: int = 64) -> torch.Tensor:
    """Attention of one query per sequence over its paged context; returns [B, Hq, D] in q's dtype.

    q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32;
    context_lens [B] int32 (a 0 yields zeros). max_context_len is a host-side upper bound on
    context_lens (default: the block table's capacity); it and num_splits only shape the launch, so
    nothing here waits on the device.
    """
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"q heads {num_q_heads} x {head_dim} do not fit the cache's {num_kv_heads} x "
                         f"{k_cache.shape[3]}")
    group = num_q_heads // num_kv_heads
    out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    num_splits, split_len = plan_splits(batch, num_kv_heads, max_context_len, block_n, q.device, num_splits)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    dot_fp32, dot_precision = dot_options(q.dtype)

    single = num_splits == 1
    part_shape = (batch, num_q_heads, num_splits) if not single else (1, 1, 1)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(*part_shape, head_dim, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_max, part_sum,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        *part_max.stride(), scale * LOG2E, block_size, split_len,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_N=block_n, SINGLE_SPLIT=single, DOT_FP32=dot_fp32, DOT_PRECISION=dot_precision,
    )
    if not single:
        _decode_reduce_kernel[(batch, num_q_heads)](
            out, part_acc, part_max, part_sum, *out.stride(), *part_max.stride(),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
        )
    return out


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """Plain-torch decode: gather each context through its block table, dense softmax in fp32."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for b, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        positions = torch.arange(context_len, device=q.device)
        blocks = block_tables[b].long()[positions // block_size]
        k = k_cache[blocks, positions % block_size].float()  # [L, Hkv, D]
        v = v_cache[blocks, positions % block_size].float()
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale  # [Hq, L]
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)

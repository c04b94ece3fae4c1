"""Paged attention in plain torch: the reference backend (CPU and GPU).

Correctness first, but vectorized where it matters: decode gathers every sequence's blocks at once and
runs one scaled_dot_product_attention over the whole batch.
"""

import torch
import torch.nn.functional as F

from services.engine.layers.attention_metadata import AttentionMetadata


class TorchRefBackend:
    """The AttentionBackend protocol with torch ops only."""

    name = "torch"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)  # [N, Hq, D]
        seqlens_q, seqlens_k = _host_seqlens(meta)
        start = 0
        for b, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k)):
            end = start + len_q
            if meta.has_prefix and len_k > len_q:
                k_ctx = _gather_context(k_cache, meta.block_tables[b], len_k)  # [Lk, Hkv, D]
                v_ctx = _gather_context(v_cache, meta.block_tables[b], len_k)
            else:
                k_ctx, v_ctx = k[start:end], v[start:end]
            out[start:end] = _causal_attention(q[start:end], k_ctx, v_ctx, scale)
            start = end
        return out

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        block_size = k_cache.shape[1]
        if meta.seqlens_k_cpu is None:
            return _decode_rows(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        groups = _decode_groups(meta.seqlens_k_cpu, block_size, k_cache[0].numel())
        if len(groups) == 1:
            return _decode_rows(q, k_cache, v_cache, meta.block_tables[:, :groups[0][1]], meta.context_lens, scale)
        out = torch.empty_like(q)  # [B, Hq, D]
        for rows, num_blocks in groups:
            index = torch.tensor(rows, device=q.device)
            out[index] = _decode_rows(q[index], k_cache, v_cache, meta.block_tables[index, :num_blocks],
                                      meta.context_lens[index], scale)
        return out


# A decode group holds at most this many cache elements once gathered (per K and per V).
DECODE_GATHER_BUDGET = 1 << 25


def _decode_groups(context_lens: list[int], block_size: int, block_numel: int) -> list[tuple[list[int], int]]:
    """Rows grouped by context length so that padding to a group's longest row at most doubles the gathered
    blocks, and a group stays within DECODE_GATHER_BUDGET: [(rows, blocks per row)]. One group when all fit."""
    blocks = [-(-n // block_size) for n in context_lens]
    if len(blocks) * max(blocks) * block_numel <= DECODE_GATHER_BUDGET:
        return [(list(range(len(blocks))), max(blocks))]
    groups: list[tuple[list[int], int]] = []
    for row in sorted(range(len(blocks)), key=blocks.__getitem__, reverse=True):
        if groups:
            rows, width = groups[-1]
            if blocks[row] * 2 >= width and (len(rows) + 1) * width * block_numel <= DECODE_GATHER_BUDGET:
                rows.append(row)
                continue
        groups.append(([row], blocks[row]))
    return groups


def _decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] over each row's first context_lens cached tokens via block_tables [B, M]; -> [B, Hq, D]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    block_ids = block_tables.flatten()  # [B * M]
    max_ctx = block_tables.shape[1] * k_cache.shape[1]
    k = _gather_blocks(k_cache, block_ids).view(num_seqs, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    v = _gather_blocks(v_cache, block_ids).view(num_seqs, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    # k, v: [B, Hkv, T, D]
    valid = torch.arange(max_ctx, device=q.device)[None, :] < context_lens[:, None]  # [B, T]
    # NOTE: the G query heads sharing a KV head are one position, so they ride as G query rows.
    q = q.reshape(num_seqs, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=valid[:, None, None, :],
                                         scale=scale)  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def _host_seqlens(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    if meta.seqlens_q_cpu is not None and meta.seqlens_k_cpu is not None:
        return meta.seqlens_q_cpu, meta.seqlens_k_cpu
    cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
    return ([cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)],
            [cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1)])


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] -> [len(block_ids), block_size, Hkv, D] (index_select beats
    advanced indexing on CPU)."""
    return cache.view(cache.shape[0], -1).index_select(0, block_ids).view(-1, *cache.shape[1:])


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, len_k: int) -> torch.Tensor:
    """The first len_k cached tokens of one sequence: [len_k, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (len_k + block_size - 1) // block_size
    return _gather_blocks(cache, block_table[:num_blocks]).flatten(0, 1)[:len_k]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] at the last Lq positions of a context k, v [Lk, Hkv, D]; returns [Lq, Hq, D]."""
    len_q, len_k = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    q_t = q.transpose(0, 1)  # [Hq, Lq, D]
    k_t = k.to(q.dtype).transpose(0, 1)  # [Hkv, Lk, D]
    v_t = v.to(q.dtype).transpose(0, 1)
    if group > 1:
        k_t = k_t.repeat_interleave(group, dim=0)  # [Hq, Lk, D]
        v_t = v_t.repeat_interleave(group, dim=0)
    if len_q == len_k:
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, scale=scale)
    else:
        rows = torch.arange(len_q, device=q.device)[:, None] + (len_k - len_q)
        mask = torch.arange(len_k, device=q.device)[None, :] <= rows  # [Lq, Lk]
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)

"""Shared builders for the kernel tests: random paged caches and a naive dense attention to check against."""

import math

import torch

ATOL, RTOL = 1e-4, 1e-3  # fp32


def randn(*shape: int, gen: torch.Generator, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def paged_layout(context_lens: list[int], block_size: int, gen: torch.Generator,
                 num_spare_blocks: int = 3) -> tuple[int, torch.Tensor]:
    """Shuffled physical blocks for each context: (num_blocks, block_tables [B, max_blocks + 1] int32).

    Tables are padded with 0 like the runner's; a spare column and spare blocks make stray reads visible.
    """
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for b, count in enumerate(blocks_per_seq):
        for i in range(count):
            block_tables[b, i] = physical.pop()
    return num_blocks, block_tables


def scatter_to_cache(contexts: list[torch.Tensor], block_tables: torch.Tensor, num_blocks: int,
                     block_size: int, gen: torch.Generator) -> torch.Tensor:
    """A cache [num_blocks, block_size, Hkv, D] of random junk holding each context [L_b, Hkv, D]."""
    num_kv_heads, head_dim = contexts[0].shape[1:]
    device, dtype = contexts[0].device, contexts[0].dtype
    cache = randn(num_blocks, block_size, num_kv_heads, head_dim, gen=gen, device=device, dtype=dtype)
    for b, ctx in enumerate(contexts):
        for i in range(math.ceil(ctx.shape[0] / block_size)):
            rows = ctx[i * block_size:(i + 1) * block_size]
            cache[int(block_tables[b, i]), :rows.shape[0]] = rows
    return cache


def paged_kv(k_contexts: list[torch.Tensor], v_contexts: list[torch.Tensor], block_size: int,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables) holding the given per-sequence keys and values."""
    num_blocks, block_tables = paged_layout([k.shape[0] for k in k_contexts], block_size, gen)
    k_cache = scatter_to_cache(k_contexts, block_tables, num_blocks, block_size, gen)
    v_cache = scatter_to_cache(v_contexts, block_tables, num_blocks, block_size, gen)
    return k_cache, v_cache, block_tables.to(k_cache.device)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Naive float64 attention of q [Lq, Hq, D] at the last Lq positions of k, v [L, Hkv, D] (unpaged).

    Query i sees keys 0 .. L - Lq + i. Returns [Lq, Hq, D] in float64.
    """
    len_q, num_q_heads, _ = q.shape
    len_k, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_q_heads):
        qh, kh, vh = q[:, h].double().cpu(), k[:, h // group].double().cpu(), v[:, h // group].double().cpu()
        scores = qh @ kh.T * scale  # [Lq, L]
        for i in range(len_q):
            visible = len_k - len_q + i + 1
            weights = torch.softmax(scores[i, :visible], dim=0)
            out[i, h] = weights @ vh[:visible]
    return out

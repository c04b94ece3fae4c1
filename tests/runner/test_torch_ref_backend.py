"""The torch reference backend against dense causal attention computed naively, head by head."""

import math

import pytest
import torch

from services.engine.layers.attention_backends import torch_ref
from services.engine.layers.attention_backends.torch_ref import TorchRefBackend
from services.engine.layers.attention_metadata import AttentionMetadata

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 3, 24, 4, 16  # non-power-of-two layout
SCALE = HEAD_DIM ** -0.5
SEQ_LENS = [11, 5, 8]
BLOCK_TABLES = [[9, 2, 14], [0, 7], [5, 11]]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int) -> torch.Tensor:
    """q [Lq, Hq, D] at positions first_position.., k/v [Lk, Hkv, D] from position 0; loops, no SDPA."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        for i in range(q.shape[0]):
            visible = first_position + i + 1
            scores = [float(q[i, h] @ k[j, h // group]) * SCALE for j in range(visible)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[i, h] = sum(w / total * v[j, h // group] for j, w in enumerate(weights))
    return out


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    q = [torch.randn(n, NUM_Q_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for n in SEQ_LENS]
    k = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for n in SEQ_LENS]
    v = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for n in SEQ_LENS]
    caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
              for _ in range(2)]
    return q, k, v, caches


def _slots(seq: int, lo: int, hi: int) -> list[int]:
    table = BLOCK_TABLES[seq]
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(lo, hi)]


def _tables(seqs: list[int]) -> torch.Tensor:
    width = max(len(BLOCK_TABLES[s]) for s in seqs)
    return torch.tensor([BLOCK_TABLES[s] + [0] * (width - len(BLOCK_TABLES[s])) for s in seqs], dtype=torch.int32)


def _prefill_meta(chunks: list[tuple[int, int, int]], with_prefix: bool) -> AttentionMetadata:
    lens_q = [hi - lo for _, lo, hi in chunks]
    lens_k = [hi for _, _, hi in chunks]
    return AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.tensor([s for seq, lo, hi in chunks for s in _slots(seq, lo, hi)], dtype=torch.int64),
        block_tables=_tables([seq for seq, _, _ in chunks]) if with_prefix else None,
        cu_seqlens_q=torch.tensor([0] + lens_q).cumsum(0).to(torch.int32),
        cu_seqlens_k=torch.tensor([0] + lens_k).cumsum(0).to(torch.int32),
        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
        seqlens_q_cpu=lens_q, seqlens_k_cpu=lens_k,
    )


def _run_prefill(backend, data, chunks, with_prefix):
    q, k, v, (k_cache, v_cache) = data
    q_new = torch.cat([q[s][lo:hi] for s, lo, hi in chunks])
    k_new = torch.cat([k[s][lo:hi] for s, lo, hi in chunks])
    v_new = torch.cat([v[s][lo:hi] for s, lo, hi in chunks])
    meta = _prefill_meta(chunks, with_prefix)
    backend.store_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    return backend.prefill(q_new, k_new, v_new, k_cache, v_cache, meta, SCALE)


def _expected(data, chunks):
    q, k, v, _ = data
    return torch.cat([naive_attention(q[s][lo:hi], k[s][:hi], v[s][:hi], lo) for s, lo, hi in chunks])


def test_store_kv_writes_only_the_mapped_slots(data):
    _, k, v, (k_cache, v_cache) = data
    before = k_cache.clone()
    slots = torch.tensor(_slots(0, 0, 11))
    TorchRefBackend().store_kv(k[0], v[0], k_cache, v_cache, slots)
    flat = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[slots], k[0])
    assert torch.equal(v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], v[0])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], before.view(-1, NUM_KV_HEADS, HEAD_DIM)[untouched])


def test_prefill_without_prefix(data):
    chunks = [(0, 0, 11), (1, 0, 5), (2, 0, 8)]
    out = _run_prefill(TorchRefBackend(), data, chunks, with_prefix=False)
    torch.testing.assert_close(out, _expected(data, chunks), rtol=1e-9, atol=1e-9)


def test_chunked_prefill_reads_the_cached_prefix(data):
    backend = TorchRefBackend()
    first = [(0, 0, 6), (1, 0, 5), (2, 0, 3)]
    _run_prefill(backend, data, first, with_prefix=False)
    second = [(0, 6, 11), (2, 3, 8)]
    out = _run_prefill(backend, data, second, with_prefix=True)
    torch.testing.assert_close(out, _expected(data, second), rtol=1e-9, atol=1e-9)


def test_prefix_batch_mixing_a_fresh_sequence(data):
    backend = TorchRefBackend()
    _run_prefill(backend, data, [(0, 0, 9)], with_prefix=False)
    chunks = [(1, 0, 5), (0, 9, 11)]
    out = _run_prefill(backend, data, chunks, with_prefix=True)
    torch.testing.assert_close(out, _expected(data, chunks), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("gather_budget", [None, 1])
def test_decode_batch_with_different_context_lengths(data, monkeypatch, gather_budget):
    """With a tiny gather budget every row is decoded in a group of its own; the result must not change."""
    if gather_budget is not None:
        monkeypatch.setattr(torch_ref, "DECODE_GATHER_BUDGET", gather_budget)
    backend = TorchRefBackend()
    q, k, v, (k_cache, v_cache) = data
    prompt = [(0, 0, 10), (1, 0, 4), (2, 0, 7)]
    _run_prefill(backend, data, prompt, with_prefix=False)
    last = [(s, hi, hi + 1) for s, _, hi in prompt]
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.tensor([_slots(s, lo, hi)[0] for s, lo, hi in last]),
        block_tables=_tables([0, 1, 2]),
        context_lens=torch.tensor([hi for _, _, hi in last], dtype=torch.int32),
        max_seqlen_q=1, max_seqlen_k=11, seqlens_k_cpu=[hi for _, _, hi in last],
    )
    backend.store_kv(torch.stack([k[s][lo] for s, lo, _ in last]), torch.stack([v[s][lo] for s, lo, _ in last]),
                     k_cache, v_cache, meta.slot_mapping)
    out = backend.decode(torch.stack([q[s][lo] for s, lo, _ in last]), k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out, _expected(data, last), rtol=1e-9, atol=1e-9)


def test_decode_groups_bound_padding_and_size(monkeypatch):
    assert torch_ref._decode_groups([40, 3, 17], 4, 10) == [([0, 1, 2], 10)]
    monkeypatch.setattr(torch_ref, "DECODE_GATHER_BUDGET", 300)
    # blocks per row: 10, 1, 5, 9, 2 -> sorted 10, 9, 5 | 2, 1; a group of width 10 holds at most 3 rows
    assert torch_ref._decode_groups([40, 3, 17, 33, 8], 4, 10) == [([0, 3, 2], 10), ([4, 1], 2)]

"""TritonBackend through the AttentionBackend protocol: chunked prefill, prefix prefill and decode of a
small batch, each step against dense attention over the whole sequences."""

import pytest
import torch

from services.engine.layers.attention_backends.base import AttentionBackend
from services.engine.layers.attention_backends.triton import TritonBackend
from services.engine.layers.attention_metadata import AttentionMetadata
from tests.kernels.helpers import ATOL, RTOL, dense_attention, randn

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 9, 3, 64, 8, 8
SEQ_LENS = [30, 13]
BLOCK_TABLES = [[5, 2, 7, 0], [3, 6]]
SCALE = HEAD_DIM ** -0.5


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _slots(seq: int, positions: range) -> list[int]:
    return [BLOCK_TABLES[seq][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def _padded_tables(seqs, device):
    width = max(len(BLOCK_TABLES[s]) for s in seqs)
    return _i32([BLOCK_TABLES[s] + [0] * (width - len(BLOCK_TABLES[s])) for s in seqs], device)


def _prefill_meta(chunks, with_prefix, device):
    """chunks: (seq, first position, last position + 1) of each sequence's new tokens."""
    lens_q = [hi - lo for _, lo, hi in chunks]
    lens_k = [hi for _, _, hi in chunks]
    return AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.tensor([s for seq, lo, hi in chunks for s in _slots(seq, range(lo, hi))],
                                  dtype=torch.int64, device=device),
        block_tables=_padded_tables([seq for seq, _, _ in chunks], device) if with_prefix else None,
        cu_seqlens_q=torch.tensor([0] + lens_q, device=device).cumsum(0).to(torch.int32),
        cu_seqlens_k=torch.tensor([0] + lens_k, device=device).cumsum(0).to(torch.int32),
        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), seqlens_q_cpu=lens_q, seqlens_k_cpu=lens_k,
    )


def _prefill_inputs(qkv, chunks, with_prefix, device):
    q, k, v = (torch.cat([t[seq][lo:hi] for seq, lo, hi in chunks]) for t in qkv)
    return _prefill_meta(chunks, with_prefix, device), q, k, v


def _run_prefill(backend: AttentionBackend, caches, inputs):
    meta, q, k, v = inputs
    backend.store_kv(k, v, *caches, meta.slot_mapping)
    return backend.prefill(q, k, v, *caches, meta, SCALE)


def test_triton_backend_chunked_prefill_prefix_and_decode(device):
    gen = torch.Generator().manual_seed(0)
    qs, ks, vs = ([randn(n, heads, HEAD_DIM, gen=gen, device=device) for n in SEQ_LENS]
                  for heads in (NUM_Q_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    expected = [dense_attention(qs[b], ks[b], vs[b], SCALE).float().to(device) for b in range(len(SEQ_LENS))]
    caches = (randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, gen=gen, device=device),
              randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, gen=gen, device=device))
    backend: AttentionBackend = TritonBackend()
    assert backend.name == "triton"

    # Step 1: first chunk of sequence 0 and all but the last token of sequence 1, nothing cached yet.
    out = _run_prefill(backend, caches, _prefill_inputs((qs, ks, vs), [(0, 0, 18), (1, 0, 12)], False, device))
    torch.testing.assert_close(out, torch.cat([expected[0][:18], expected[1][:12]]), atol=ATOL, rtol=RTOL)

    # Step 2: the rest of sequence 0's prompt over its cached first chunk (misaligned: 18 = 2 * 8 + 2).
    out = _run_prefill(backend, caches, _prefill_inputs((qs, ks, vs), [(0, 18, 29)], True, device))
    torch.testing.assert_close(out, expected[0][18:29], atol=ATOL, rtol=RTOL)

    # Step 3: decode the last token of each sequence, plus a padded row (slot -1, empty context).
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.tensor(_slots(0, range(29, 30)) + _slots(1, range(12, 13)) + [-1], device=device),
        block_tables=_i32([BLOCK_TABLES[0], BLOCK_TABLES[1] + [0, 0], [0, 0, 0, 0]], device),
        context_lens=_i32([30, 13, 0], device),
    )
    pad = torch.ones(1, NUM_KV_HEADS, HEAD_DIM, device=device)
    k_new = torch.cat([ks[0][29:], ks[1][12:], pad])
    v_new = torch.cat([vs[0][29:], vs[1][12:], pad])
    q_new = torch.cat([qs[0][29:], qs[1][12:], pad.repeat(1, NUM_Q_HEADS // NUM_KV_HEADS, 1)])
    backend.store_kv(k_new, v_new, *caches, meta.slot_mapping)
    out = backend.decode(q_new, *caches, meta, SCALE)

    torch.testing.assert_close(out[:2], torch.cat([expected[0][29:], expected[1][12:]]), atol=ATOL, rtol=RTOL)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_decode_with_forced_splits_matches_single_split(device):
    gen = torch.Generator().manual_seed(1)
    q = randn(2, NUM_Q_HEADS, HEAD_DIM, gen=gen, device=device)
    caches = [randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, gen=gen, device=device) for _ in range(2)]
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(2, dtype=torch.int64, device=device),
                             block_tables=_padded_tables([0, 1], device), context_lens=_i32([29, 13], device))

    single = TritonBackend().decode(q, *caches, meta, SCALE)
    split = TritonBackend(decode_num_splits=2).decode(q, *caches, meta, SCALE)

    torch.testing.assert_close(split, single, atol=ATOL, rtol=RTOL)


def test_backend_never_waits_on_the_device(device):
    """torch's sync debug mode raises on any device-to-host sync inside the three backend calls."""
    if device.type != "cuda":
        pytest.skip("sync detection needs a CUDA device (run with TRITON_INTERPRET=0 on the GPU)")
    gen = torch.Generator().manual_seed(2)
    qkv = [[randn(n, heads, HEAD_DIM, gen=gen, device=device) for n in SEQ_LENS]
           for heads in (NUM_Q_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)]
    caches = [randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, gen=gen, device=device) for _ in range(2)]
    decode_meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(2, dtype=torch.int64, device=device),
                                    block_tables=_padded_tables([0, 1], device), context_lens=_i32([29, 13], device))
    first = _prefill_inputs(qkv, [(0, 0, 18), (1, 0, 12)], False, device)
    second = _prefill_inputs(qkv, [(0, 18, 29)], True, device)
    backend = TritonBackend()

    def steps():
        _run_prefill(backend, caches, first)
        _run_prefill(backend, caches, second)
        backend.decode(qkv[0][0][:2], *caches, decode_meta, SCALE)

    steps()  # compiles the kernels outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps()
    finally:
        torch.cuda.set_sync_debug_mode("default")

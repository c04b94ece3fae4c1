"""Prefill and decode input preparation on a hand-built batch (block size 4)."""

import torch

from services.engine.runner.inputs import prepare_decode, prepare_prefill
from tests.runner.helpers import make_seq

CPU = torch.device("cpu")


def _mixed_prefill_batch():
    whole = make_seq(0, list(range(100, 110)), [7, 2, 5])  # 10 new tokens, sampled
    prefix_hit = make_seq(1, list(range(200, 209)), [3, 6, 1], num_cached_tokens=4)  # 5 new, sampled
    first_chunk = make_seq(2, list(range(300, 312)), [0, 4, 8], num_scheduled_tokens=6)  # not sampled yet
    return [whole, prefix_hit, first_chunk]


def test_prefill_positions_slots_and_sampled_rows():
    inputs = prepare_prefill(_mixed_prefill_batch(), 4, CPU)
    assert inputs.input_ids.tolist() == list(range(100, 110)) + list(range(204, 209)) + list(range(300, 306))
    assert inputs.positions.tolist() == list(range(10)) + list(range(4, 9)) + list(range(6))
    assert inputs.meta.slot_mapping.tolist() == ([28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
                                                 + [24, 25, 26, 27, 4] + [0, 1, 2, 3, 16, 17])
    assert inputs.meta.slot_mapping.dtype == torch.int64
    assert inputs.logits_indices.tolist() == [9, 14]
    assert inputs.sample_seq_indices == [0, 1]


def test_prefill_cu_seqlens_and_block_tables_with_cached_prefix():
    meta = prepare_prefill(_mixed_prefill_batch(), 4, CPU).meta
    assert meta.is_prefill and meta.has_prefix
    assert meta.cu_seqlens_q.tolist() == [0, 10, 15, 21]
    assert meta.cu_seqlens_k.tolist() == [0, 10, 19, 25]
    assert meta.cu_seqlens_q.dtype == torch.int32
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (10, 10)
    assert meta.seqlens_q_cpu == [10, 5, 6] and meta.seqlens_k_cpu == [10, 9, 6]
    assert meta.block_tables.tolist() == [[7, 2, 5], [3, 6, 1], [0, 4, 8]]


def test_prefill_without_cached_tokens_has_no_block_tables():
    seqs = [make_seq(0, [1, 2, 3], [4]), make_seq(1, [5, 6, 7, 8, 9], [1, 2])]
    meta = prepare_prefill(seqs, 4, CPU).meta
    assert meta.block_tables is None and not meta.has_prefix
    assert meta.slot_mapping.tolist() == [16, 17, 18, 4, 5, 6, 7, 8]


def test_later_chunk_reads_its_earlier_chunk_from_the_cache():
    chunk = make_seq(0, list(range(50, 62)), [9, 3, 1], num_cached_tokens=6, num_scheduled_tokens=6)
    inputs = prepare_prefill([chunk], 4, CPU)
    assert inputs.positions.tolist() == list(range(6, 12))
    assert inputs.meta.slot_mapping.tolist() == [14, 15, 4, 5, 6, 7]
    assert inputs.meta.cu_seqlens_k.tolist() == [0, 12]
    assert inputs.meta.block_tables.tolist() == [[9, 3, 1]]
    assert inputs.sample_seq_indices == [0]


def test_decode_inputs():
    seqs = [make_seq(0, list(range(10, 15)), [6, 2], num_cached_tokens=4),
            make_seq(1, list(range(20, 29)), [1, 5, 3], num_cached_tokens=8)]
    inputs = prepare_decode(seqs, 4, CPU)
    meta = inputs.meta
    assert not meta.is_prefill
    assert inputs.input_ids.tolist() == [14, 28]
    assert inputs.positions.tolist() == [4, 8]
    assert meta.slot_mapping.tolist() == [8, 12]
    assert meta.context_lens.tolist() == [5, 9]
    assert meta.block_tables.tolist() == [[6, 2, 0], [1, 5, 3]]
    assert meta.block_tables.dtype == torch.int32
    assert inputs.sample_seq_indices == [0, 1]

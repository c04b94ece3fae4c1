"""Persistent block tables: updated incrementally, they always equal a from-scratch rebuild."""

import random

import pytest
import torch

from services.engine.core.config import SchedulerConfig
from services.engine.core.interfaces import SchedulerOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.scheduler import Scheduler
from services.engine.core.sequence import Sequence
from services.engine.runner.block_tables import PersistentBlockTables
from services.engine.runner.inputs import StepInputBuilder, StepInputs, build_decode, build_prefill
from tests.runner.helpers import make_seq

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def assert_same_step(step: StepInputs, expected: StepInputs) -> None:
    assert step.is_prefill == expected.is_prefill
    assert torch.equal(step.token_data, expected.token_data)
    assert step.seqlens_k == expected.seqlens_k and step.sample_seq_indices == expected.sample_seq_indices
    if expected.block_tables is None:
        assert step.block_tables is None
    else:
        assert torch.equal(step.block_tables, expected.block_tables)
    if step.is_prefill:
        assert torch.equal(step.cu_seqlens, expected.cu_seqlens)
        assert torch.equal(step.logits_indices, expected.logits_indices)
    else:
        assert torch.equal(step.context_lens, expected.context_lens)


def scratch(batch: SchedulerOutput) -> StepInputs:
    return (build_prefill if batch.is_prefill else build_decode)(batch.seqs, BLOCK_SIZE)


@pytest.mark.parametrize("seed", range(4))
def test_tables_equal_a_rebuild_through_preemption_finishes_and_aborts(seed):
    """A small cache forces preemptions (re-prefill into other blocks); sequences finish, are aborted and are
    replaced, so rows are reclaimed and reused. Every step's inputs equal those of a fresh builder."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64, block_size=BLOCK_SIZE,
                             num_kvcache_blocks=14)
    scheduler = Scheduler(config, eos_token_ids=[0])
    builder = StepInputBuilder(BLOCK_SIZE, 16, max_num_seqs=2, device=CPU)
    live: list[Sequence] = []
    num_finished = 0
    for seq_id in range(40):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
        seq = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 14)))
        scheduler.add(seq)
        live.append(seq)
        for _ in range(rng.randrange(1, 4)):
            if rng.random() < 0.1 and live:
                scheduler.abort(live.pop(rng.randrange(len(live))))
            batch = scheduler.schedule()
            if not batch.seqs:
                continue
            expected = scratch(batch)
            step = builder.build(batch)
            assert_same_step(step, expected)
            sampled = [rng.randrange(1, 50) for _ in batch.seqs]
            num_finished += sum(seq.is_finished for seq in scheduler.postprocess(batch, sampled))
    assert scheduler.num_preemptions > 0 and num_finished > 0
    assert builder.tables.num_rows <= 16, "rows of finished and preempted sequences must be reused"


def test_a_reused_row_holds_only_the_new_sequence_blocks():
    tables = PersistentBlockTables(max_blocks_per_seq=4, num_rows=1)
    long = make_seq(0, list(range(14)), [5, 6, 7, 8])
    assert tables.rows_for([long]) == [0]
    long.block_table = []  # finished: the block manager replaces the list
    long.status = long.status.FINISHED
    short = make_seq(1, [1, 2], [3])
    assert tables.rows_for([short]) == [0]
    assert tables.array[0].tolist() == [3, 0, 0, 0]


def test_appended_blocks_and_a_preempted_sequence_are_picked_up():
    tables = PersistentBlockTables(max_blocks_per_seq=4, num_rows=2)
    seq = make_seq(0, list(range(8)), [5, 6])
    row = tables.rows_for([seq])[0]
    seq.block_table.append(9)
    tables.rows_for([seq])
    assert tables.array[row].tolist() == [5, 6, 9, 0]
    seq.block_table = [2, 6]  # preempted and admitted again: a new list, maybe of the same length
    tables.rows_for([seq])
    assert tables.array[row].tolist() == [2, 6, 0, 0]


def test_rows_grow_when_every_row_is_live():
    tables = PersistentBlockTables(max_blocks_per_seq=2, num_rows=1)
    seqs = [make_seq(i, [1, 2, 3], [i, 10 + i]) for i in range(5)]
    rows = tables.rows_for(seqs)
    assert len(set(rows)) == 5 and tables.num_rows >= 5
    assert [tables.array[row].tolist() for row in rows] == [[i, 10 + i] for i in range(5)]


def test_a_table_longer_than_a_row_is_refused():
    tables = PersistentBlockTables(max_blocks_per_seq=2, num_rows=1)
    with pytest.raises(ValueError):
        tables.rows_for([make_seq(0, list(range(9)), [1, 2, 3])])

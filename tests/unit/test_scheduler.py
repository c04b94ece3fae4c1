"""Scheduler: every rule of ARCHITECTURE.md §2, with fabricated sampled tokens (no model)."""

import itertools
from collections.abc import Iterable

from services.engine.core.config import SchedulerConfig
from services.engine.core.interfaces import SchedulerOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.scheduler import Scheduler
from services.engine.core.sequence import FinishReason, Sequence, SequenceStatus

BLOCK_SIZE = 4
EOS = 2
SAMPLED = 7
_seq_ids = itertools.count()
_first_token = itertools.count(100, 50)


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    eos_token_ids: Iterable[int] = (EOS,),
    enable_prefix_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        num_kvcache_blocks=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )
    return Scheduler(config, tuple(eos_token_ids))


def make_seq(num_tokens: int | None = None, token_ids: list[int] | None = None, **sampling) -> Sequence:
    """A sequence with a prompt of distinct tokens (so no accidental prefix hits) unless given."""
    if token_ids is None:
        start = next(_first_token)
        token_ids = list(range(start, start + num_tokens))
    sampling.setdefault("max_tokens", 16)
    seq_id = next(_seq_ids)
    return Sequence(seq_id, f"req-{seq_id}", token_ids, SamplingParams(**sampling))


def add(scheduler: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        scheduler.add(seq)


def finish_step(scheduler: Scheduler, batch: SchedulerOutput, token_id: int = SAMPLED) -> list[Sequence]:
    """Fabricated runner output: `token_id` for every sequence fully computed after this step."""
    sampled = [
        token_id if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens else None
        for seq in batch.seqs
    ]
    return scheduler.postprocess(batch, sampled)


def step(scheduler: Scheduler, token_id: int = SAMPLED) -> tuple[SchedulerOutput, list[int]]:
    """One step; returns the batch and each sequence's scheduled token count."""
    batch = scheduler.schedule()
    num_scheduled = [seq.num_scheduled_tokens for seq in batch.seqs]
    finish_step(scheduler, batch, token_id)
    return batch, num_scheduled


def decode_tokens(scheduler: Scheduler, token_ids: Iterable[int]) -> None:
    for token_id in token_ids:
        batch = scheduler.schedule()
        assert not batch.is_prefill
        finish_step(scheduler, batch, token_id)


# Prefill first and the two budgets


def test_prefill_goes_before_decode():
    scheduler = make_scheduler()
    first, second = make_seq(4), make_seq(4)
    add(scheduler, first)
    step(scheduler)
    add(scheduler, second)
    batch, _ = step(scheduler)
    assert batch.is_prefill and batch.seqs == [second]
    assert first.num_tokens == 5
    batch, _ = step(scheduler)
    assert not batch.is_prefill and batch.seqs == [first, second]


def test_decode_when_waiting_cannot_get_blocks():
    scheduler = make_scheduler(num_blocks=3)
    running = make_seq(4)
    add(scheduler, running)
    step(scheduler)
    blocked = make_seq(9)
    add(scheduler, blocked)
    batch, _ = step(scheduler)
    assert not batch.is_prefill and batch.seqs == [running]
    assert blocked.block_table == [] and list(scheduler.waiting) == [blocked]


def test_max_num_seqs_caps_prefill_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3) for _ in range(3)]
    add(scheduler, *seqs)
    batch, _ = step(scheduler)
    assert batch.seqs == seqs[:2]
    assert list(scheduler.waiting) == seqs[2:] and seqs[2].block_table == []


def test_max_num_seqs_caps_decode_batch_and_the_rest_waits_without_kv():
    # NOTE: our refinement of the seed (see the scheduler's docstring): the third is never admitted to
    # `running` past the cap, so it neither decodes nor holds blocks until a slot frees.
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3) for _ in range(3)]
    add(scheduler, *seqs)
    step(scheduler)
    batch, _ = step(scheduler)
    assert not batch.is_prefill and batch.seqs == seqs[:2]
    assert list(scheduler.running) == seqs[:2]
    assert list(scheduler.waiting) == seqs[2:] and seqs[2].block_table == []


def test_token_budget_caps_decode_batch():
    scheduler = make_scheduler(max_num_batched_tokens=2)
    seqs = [make_seq(2) for _ in range(3)]
    add(scheduler, *seqs)
    for _ in seqs:
        step(scheduler)
    batch, _ = step(scheduler)
    assert not batch.is_prefill and batch.seqs == seqs[:2]


def test_sequence_that_does_not_fit_budget_ends_prefill_batch():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    first, second, small = make_seq(6), make_seq(6), make_seq(2)
    add(scheduler, first, second, small)
    batch, num_scheduled = step(scheduler)
    assert batch.seqs == [first] and num_scheduled == [6]
    assert second.block_table == [] and second.num_cached_tokens == 0
    assert list(scheduler.waiting) == [second, small]


def test_first_sequence_is_chunked_to_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    long, short = make_seq(10), make_seq(2)
    add(scheduler, long, short)
    batch, num_scheduled = step(scheduler)
    assert batch.is_prefill and batch.seqs == [long] and num_scheduled == [4]
    assert long.num_cached_tokens == 4 and long.num_tokens == 10
    assert long.status == SequenceStatus.WAITING and scheduler.waiting[0] is long
    assert len(long.block_table) == 3


def test_chunked_prefill_continues_and_joins_running_when_complete():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    long, short = make_seq(10), make_seq(2)
    add(scheduler, long, short)
    step(scheduler)
    batch, num_scheduled = step(scheduler)
    assert batch.seqs == [long] and num_scheduled == [4]
    assert long.num_completion_tokens == 0 and list(scheduler.running) == []
    batch, num_scheduled = step(scheduler)
    assert batch.seqs == [long, short] and num_scheduled == [2, 2]
    assert list(scheduler.running) == [long, short]
    assert long.status == SequenceStatus.RUNNING
    assert long.completion_token_ids == [SAMPLED]


def test_mid_prefill_sequence_appends_nothing():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(6)
    add(scheduler, seq)
    batch = scheduler.schedule()
    assert scheduler.postprocess(batch, [None]) == []
    assert seq.num_tokens == 6 and seq.num_cached_tokens == 4


def test_prefix_cached_tokens_do_not_count_against_budget():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    owner = make_seq(9)
    add(scheduler, owner)
    step(scheduler)
    step(scheduler)
    sharer = make_seq(token_ids=owner.token_ids[:8] + [99])
    other = make_seq(5)
    add(scheduler, sharer, other)
    batch, num_scheduled = step(scheduler)
    assert batch.is_prefill and batch.seqs == [sharer, other] and num_scheduled == [1, 5]
    assert sharer.block_table[:2] == owner.block_table[:2]
    assert scheduler.num_cached_prompt_tokens == 8
    assert scheduler.num_computed_prompt_tokens == 9 + 1 + 5


def test_same_prompt_twice_in_one_batch_shares_nothing_until_computed():
    scheduler = make_scheduler()
    first = make_seq(9)
    second = make_seq(token_ids=list(first.token_ids))
    add(scheduler, first, second)
    batch, num_scheduled = step(scheduler)
    assert batch.seqs == [first, second] and num_scheduled == [9, 9]
    assert not set(first.block_table) & set(second.block_table)
    third = make_seq(token_ids=first.token_ids[:9])
    add(scheduler, third)
    batch, num_scheduled = step(scheduler)
    assert batch.seqs == [third] and num_scheduled == [1]


# Decode and preemption


def test_decode_keeps_running_order():
    scheduler = make_scheduler()
    seqs = [make_seq(3) for _ in range(3)]
    add(scheduler, *seqs)
    step(scheduler)
    for _ in range(3):
        batch, num_scheduled = step(scheduler)
        assert batch.seqs == seqs and num_scheduled == [1, 1, 1]
        assert list(scheduler.running) == seqs


def test_decode_preempts_the_tail_of_running():
    scheduler = make_scheduler(num_blocks=4)
    first, second, third = make_seq(4), make_seq(4), make_seq(4)
    add(scheduler, first, second, third)
    step(scheduler)
    batch, _ = step(scheduler)
    assert batch.seqs == [first, second]
    assert list(scheduler.running) == [first, second]
    assert list(scheduler.waiting) == [third]
    assert third.status == SequenceStatus.WAITING and third.block_table == []
    assert third.num_cached_tokens == 0
    assert third.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert scheduler.block_manager.num_free_blocks == 0


def test_decode_preempts_the_newest_not_the_next_in_line():
    """LIFO, not FIFO: only `first` needs a new block, and the victim is the tail, not `second`."""
    scheduler = make_scheduler(num_blocks=4)
    first, second, third, fourth = make_seq(4), make_seq(3), make_seq(3), make_seq(3)
    add(scheduler, first, second, third, fourth)
    step(scheduler)
    batch, _ = step(scheduler)
    assert batch.seqs == [first, second, third]
    assert list(scheduler.waiting) == [fourth] and fourth.num_preemptions == 1
    assert second.num_preemptions == 0 and len(second.block_table) == 1


def test_preemption_goes_down_to_the_sequence_itself():
    scheduler = make_scheduler(num_blocks=3)
    first, second, third = make_seq(4), make_seq(4), make_seq(4)
    add(scheduler, first, second, third)
    step(scheduler)
    queued = make_seq(4)
    add(scheduler, queued)
    batch, _ = step(scheduler)
    assert not batch.is_prefill and batch.seqs == [first]
    assert list(scheduler.running) == [first]
    assert list(scheduler.waiting) == [second, third, queued]
    assert second.num_preemptions == 1 and third.num_preemptions == 1
    assert scheduler.num_preemptions == 2


def test_lone_sequence_without_room_preempts_itself():
    scheduler = make_scheduler(num_blocks=2)
    seq = make_seq(4)
    add(scheduler, seq)
    step(scheduler)
    scheduler.block_manager.allocate(make_seq(1), [])  # someone else holds the last block
    batch, _ = step(scheduler)
    assert batch.seqs == [] and not batch.is_prefill
    assert list(scheduler.waiting) == [seq] and list(scheduler.running) == []
    assert seq.num_preemptions == 1 and seq.block_table == []


def test_preempted_sequence_is_recomputed_with_its_generated_tokens():
    scheduler = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    first, second, third = make_seq(4), make_seq(4), make_seq(4)
    add(scheduler, first, second, third)
    step(scheduler, token_id=11)
    step(scheduler, token_id=12)
    assert third.num_preemptions == 1 and third.token_ids[4:] == [11]
    scheduler.abort(first)
    batch, num_scheduled = step(scheduler, token_id=13)
    assert batch.is_prefill and batch.seqs == [third] and num_scheduled == [5]
    assert third.completion_token_ids == [11, 13] and third.num_prompt_tokens == 4
    assert list(scheduler.running) == [second, third]


def test_preempted_sequence_revives_its_cached_prompt_blocks():
    scheduler = make_scheduler(num_blocks=5)
    first, second, third = make_seq(4), make_seq(5), make_seq(8)
    add(scheduler, first, second, third)
    step(scheduler)
    step(scheduler)
    assert third.num_preemptions == 1
    scheduler.abort(first)
    batch, num_scheduled = step(scheduler)
    assert batch.seqs == [third] and num_scheduled == [9 - 4]
    assert scheduler.num_cached_prompt_tokens == 4
    assert third.num_prefix_hit_tokens == 0  # the reported hits are those of the first admission


def test_nothing_to_run_gives_an_empty_batch():
    scheduler = make_scheduler()
    batch = scheduler.schedule()
    assert batch.seqs == [] and batch.num_batched_tokens == 0
    assert not scheduler.has_unfinished()


# Finishing


def test_eos_stops_and_frees_blocks():
    scheduler = make_scheduler()
    seq = make_seq(5)
    add(scheduler, seq)
    step(scheduler)
    decode_tokens(scheduler, [EOS])
    assert seq.finish_reason == FinishReason.STOP and seq.status == SequenceStatus.FINISHED
    assert seq.completion_token_ids == [SAMPLED, EOS] and seq.matched_stop_token_id is None
    assert list(scheduler.running) == [] and seq.block_table == []
    assert scheduler.block_manager.num_used_blocks == 0


def test_any_of_several_eos_ids_stops():
    scheduler = make_scheduler(eos_token_ids=(EOS, 5))
    seq = make_seq(3)
    add(scheduler, seq)
    step(scheduler)
    decode_tokens(scheduler, [5])
    assert seq.finish_reason == FinishReason.STOP


def test_eos_sampled_by_prefill_stops():
    scheduler = make_scheduler()
    seq = make_seq(3)
    add(scheduler, seq)
    batch = scheduler.schedule()
    assert finish_step(scheduler, batch, EOS) == [seq]
    assert seq.finish_reason == FinishReason.STOP and seq.num_completion_tokens == 1


def test_max_tokens_finishes_with_length():
    scheduler = make_scheduler()
    seq = make_seq(3, max_tokens=3)
    add(scheduler, seq)
    step(scheduler)
    decode_tokens(scheduler, [8])
    assert seq.finish_reason is None
    decode_tokens(scheduler, [9])
    assert seq.finish_reason == FinishReason.LENGTH and seq.completion_token_ids == [SAMPLED, 8, 9]
    assert scheduler.block_manager.num_used_blocks == 0


def test_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=6)
    seq = make_seq(4, max_tokens=10)
    add(scheduler, seq)
    step(scheduler)
    decode_tokens(scheduler, [8])
    assert seq.finish_reason == FinishReason.LENGTH and seq.num_tokens == 6


def test_ignore_eos_continues_to_max_tokens():
    scheduler = make_scheduler()
    seq = make_seq(3, max_tokens=3, ignore_eos=True)
    add(scheduler, seq)
    step(scheduler, token_id=EOS)
    decode_tokens(scheduler, [EOS])
    assert seq.finish_reason is None
    decode_tokens(scheduler, [EOS])
    assert seq.finish_reason == FinishReason.LENGTH


def test_stop_token_id_stops_and_is_recorded():
    scheduler = make_scheduler()
    seq = make_seq(3, stop_token_ids=[40, 41])
    add(scheduler, seq)
    step(scheduler)
    decode_tokens(scheduler, [41])
    assert seq.finish_reason == FinishReason.STOP and seq.matched_stop_token_id == 41


def test_stop_token_id_stops_even_with_ignore_eos():
    scheduler = make_scheduler()
    seq = make_seq(3, stop_token_ids=[40], ignore_eos=True)
    add(scheduler, seq)
    step(scheduler)
    decode_tokens(scheduler, [EOS, 40])
    assert seq.finish_reason == FinishReason.STOP and seq.completion_token_ids == [SAMPLED, EOS, 40]


def test_min_tokens_delays_stop():
    scheduler = make_scheduler()
    seq = make_seq(3, min_tokens=2, stop_token_ids=[40])
    add(scheduler, seq)
    step(scheduler, token_id=EOS)
    decode_tokens(scheduler, [40])
    assert seq.finish_reason is None and seq.num_completion_tokens == 2
    decode_tokens(scheduler, [EOS])
    assert seq.finish_reason == FinishReason.STOP and seq.num_completion_tokens == 3


# Abort


def test_abort_waiting_sequence():
    scheduler = make_scheduler()
    seq = make_seq(4)
    add(scheduler, seq)
    scheduler.abort(seq)
    assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == FinishReason.ABORTED
    assert not scheduler.has_unfinished()


def test_abort_mid_prefill_frees_blocks():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(10)
    add(scheduler, seq)
    step(scheduler)
    assert scheduler.block_manager.num_used_blocks == 3
    scheduler.abort(seq)
    assert scheduler.block_manager.num_used_blocks == 0 and seq.block_table == []
    assert list(scheduler.waiting) == [] and seq.finish_reason == FinishReason.ABORTED


def test_abort_running_sequence_frees_blocks_and_others_go_on():
    scheduler = make_scheduler()
    doomed, survivor = make_seq(5), make_seq(3)
    add(scheduler, doomed, survivor)
    step(scheduler)
    scheduler.abort(doomed)
    assert list(scheduler.running) == [survivor]
    assert scheduler.block_manager.num_used_blocks == len(survivor.block_table)
    batch, _ = step(scheduler)
    assert batch.seqs == [survivor]


def test_abort_of_finished_sequence_changes_nothing():
    scheduler = make_scheduler()
    seq = make_seq(3, max_tokens=1)
    add(scheduler, seq)
    step(scheduler)
    assert seq.finish_reason == FinishReason.LENGTH
    scheduler.abort(seq)
    assert seq.finish_reason == FinishReason.LENGTH


def test_counters_track_prompt_and_generated_tokens():
    scheduler = make_scheduler()
    seqs = [make_seq(5, max_tokens=3), make_seq(7, max_tokens=3)]
    add(scheduler, *seqs)
    while scheduler.has_unfinished():
        step(scheduler)
    assert scheduler.num_computed_prompt_tokens == 12
    assert scheduler.num_cached_prompt_tokens == 0
    assert scheduler.num_generated_tokens == 6
    assert scheduler.num_preemptions == 0

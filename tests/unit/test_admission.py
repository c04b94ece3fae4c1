"""Overload: the running set never outgrows the step caps, and the waiting bound counts only new requests.

Our one refinement of the seed's scheduler (ARCHITECTURE.md §2): a sequence joins `running` only while fewer
than max_num_seqs (and the decode token budget) run, so a late arrival waits without KV instead of getting
one token and then starving while holding blocks. The waiting bound (max_waiting) counts requests that were
never admitted; a preempted sequence is ours to finish and never makes the engine refuse a client.
"""

import pytest

from services.engine.core.admission import AdmissionRate
from services.engine.core.errors import QueueFullError
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import SequenceStatus
from tests.unit.test_engine_core import make_engine, prompt
from tests.unit.test_scheduler import add, make_scheduler, make_seq, step


def check_caps(scheduler, batch, max_num_seqs: int, max_num_batched_tokens: int) -> None:
    assert len(batch.seqs) <= max_num_seqs
    assert sum(seq.num_scheduled_tokens for seq in batch.seqs) <= max_num_batched_tokens
    assert len(scheduler.running) <= min(max_num_seqs, max_num_batched_tokens)


def test_running_never_grows_past_max_num_seqs_and_steps_keep_their_caps():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=16)
    seqs = [make_seq(6, max_tokens=5, ignore_eos=True) for _ in range(8)]
    add(scheduler, *seqs)
    for _ in range(200):
        batch = scheduler.schedule()
        if not batch.seqs:
            break
        sizes = [seq.num_scheduled_tokens for seq in batch.seqs]
        assert len(batch.seqs) <= 3 and sum(sizes) <= 16
        from tests.unit.test_scheduler import finish_step

        finish_step(scheduler, batch)
        assert len(scheduler.running) <= 3
        for seq in scheduler.waiting:
            assert not seq.block_table, "a waiting sequence past the cap holds no KV"
    assert all(seq.status == SequenceStatus.FINISHED for seq in seqs)
    assert [seq.num_completion_tokens for seq in seqs] == [5] * 8


def test_a_late_arrival_waits_without_kv_until_a_running_sequence_finishes():
    scheduler = make_scheduler(max_num_seqs=2)
    first, second = make_seq(4, max_tokens=3, ignore_eos=True), make_seq(4, max_tokens=3, ignore_eos=True)
    add(scheduler, first, second)
    step(scheduler)  # both prefilled, one token each
    late = make_seq(4, max_tokens=3, ignore_eos=True)
    add(scheduler, late)
    batch, _ = step(scheduler)
    assert not batch.is_prefill and batch.seqs == [first, second], "the late one does not displace a decode step"
    assert late.status == SequenceStatus.WAITING and not late.block_table and late.num_completion_tokens == 0
    step(scheduler)  # first and second reach max_tokens=3
    assert first.is_finished and second.is_finished
    batch, _ = step(scheduler)
    assert batch.is_prefill and batch.seqs == [late]


def test_admission_fills_only_the_free_slots():
    scheduler = make_scheduler(max_num_seqs=3)
    add(scheduler, make_seq(4, max_tokens=9))
    step(scheduler)
    add(scheduler, *(make_seq(4, max_tokens=9) for _ in range(4)))
    batch, _ = step(scheduler)
    assert batch.is_prefill and len(batch.seqs) == 2
    assert len(scheduler.running) == 3 and len(scheduler.waiting) == 2


def test_a_token_budget_below_max_num_seqs_caps_the_running_set_too():
    scheduler = make_scheduler(max_num_seqs=8, max_num_batched_tokens=2)
    add(scheduler, *(make_seq(1, max_tokens=9, ignore_eos=True) for _ in range(5)))
    for _ in range(6):
        batch, sizes = step(scheduler)
        check_caps(scheduler, batch, 8, 2)
    assert len(scheduler.running) == 2
    assert all(seq.num_completion_tokens > 1 for seq in scheduler.running), "every running sequence decodes"


def test_a_preempted_sequence_is_readmitted_within_the_cap():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2)
    seqs = [make_seq(4, max_tokens=6, ignore_eos=True) for _ in range(3)]
    add(scheduler, *seqs)
    for _ in range(40):
        batch = scheduler.schedule()
        if not batch.seqs:
            break
        check_caps(scheduler, batch, 2, 64)
        from tests.unit.test_scheduler import finish_step

        finish_step(scheduler, batch)
    assert scheduler.num_preemptions > 0
    assert [seq.num_completion_tokens for seq in seqs] == [6, 6, 6]


# The waiting bound


def test_num_queued_counts_new_sequences_even_mid_prefill_but_not_preempted_ones():
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=4)
    running, chunked, queued = make_seq(4), make_seq(10), make_seq(4)
    add(scheduler, running)
    step(scheduler)
    add(scheduler, chunked, queued)
    step(scheduler)  # chunked has 4 of its 10 tokens computed and its blocks held
    assert chunked.block_table and scheduler.num_queued == 2
    scheduler.preempt(scheduler.running.pop())
    assert len(scheduler.waiting) == 3 and scheduler.num_queued == 2


def test_preempted_sequences_do_not_count_against_max_waiting():
    engine = make_engine(max_waiting=2)
    engine.add_request("a", prompt(4), SamplingParams(max_tokens=8))
    engine.step()
    engine.scheduler.preempt(engine.scheduler.running.pop())  # "a" back in waiting, by our doing
    engine.add_request("b", prompt(4, 50), SamplingParams())
    engine.add_request("c", prompt(4, 80), SamplingParams())  # the old rule counted "a": refused here
    assert len(engine.scheduler.waiting) == 3
    with pytest.raises(QueueFullError):
        engine.add_request("d", prompt(4, 110), SamplingParams())  # exactly max_waiting new ones wait: full


def test_retry_delay_is_the_time_to_admit_the_queue_at_the_recent_rate():
    rate = AdmissionRate(window=4)
    assert rate.retry_delay_s(num_queued=4, now=0.0) == AdmissionRate.DEFAULT_DELAY_S
    for t in (10.0, 10.5, 11.0, 11.5):
        rate.record(1, t)
    # 4 admissions in the 2 s since the oldest one: 2 per second; 4 queued drain in 2 s
    assert rate.retry_delay_s(num_queued=4, now=12.0) == pytest.approx(2.0)
    assert rate.retry_delay_s(num_queued=10_000, now=12.0) == AdmissionRate.MAX_DELAY_S
    assert rate.retry_delay_s(num_queued=0, now=12.0) == AdmissionRate.MIN_DELAY_S


def test_a_stalled_engine_asks_for_longer_waits():
    rate = AdmissionRate(window=4)
    for t in (0.0, 0.1, 0.2, 0.3):
        rate.record(1, t)
    assert rate.retry_delay_s(num_queued=4, now=0.4) < rate.retry_delay_s(num_queued=4, now=8.0)


def test_queue_full_error_carries_the_estimated_delay():
    engine = make_engine(max_waiting=1)
    engine.add_request("a", prompt(4), SamplingParams())
    with pytest.raises(QueueFullError) as error:
        engine.add_request("b", prompt(4, 50), SamplingParams())
    assert error.value.retry_after_s == AdmissionRate.DEFAULT_DELAY_S  # nothing admitted yet: no rate known

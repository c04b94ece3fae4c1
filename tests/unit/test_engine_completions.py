"""EngineCore with sampling.n > 1 and a fake runner: aborting one completion (its siblings go on, its blocks are
freed, shared prompt blocks keep the right reference counts) and best_of (held back, the n best by cumulative
logprob released whole, renumbered by rank)."""

from collections import defaultdict

import pytest

from services.engine.core.config import SchedulerConfig
from services.engine.core.engine import EngineCore
from services.engine.core.errors import InvalidRequestError
from services.engine.core.interfaces import RequestOutput, SchedulerOutput, TokenLogprobs
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import FinishReason

BLOCK_SIZE = 4
PROMPT = list(range(10, 20))  # 2 full blocks + a partial one
MAX_TOKENS = 6


class CompletionRunner:
    """Fake runner: completion i samples 100 + 10 * i + k at sample index k; with `logprobs` (per completion index,
    one value per sample index) it also answers take_logprobs like the real runner, for the asking sequences."""

    def __init__(self, logprobs: dict[int, list[float]] | None = None):
        self.logprobs = logprobs
        self.samples: dict[int, int] = defaultdict(int)  # completion index -> tokens sampled
        self.num_logprobs_seen: set = set()
        self._last: dict[int, TokenLogprobs] = {}

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        sampled, self._last = [], {}
        for seq in batch.seqs:
            if seq.num_cached_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                sampled.append(None)
                continue
            k = seq.num_completion_tokens
            self.samples[seq.index] += 1
            self.num_logprobs_seen.add(seq.sampling.num_logprobs)
            if self.logprobs is not None and seq.sampling.num_logprobs is not None:
                self._last[seq.seq_id] = TokenLogprobs(self.logprobs[seq.index][k], [], [])
            sampled.append(100 + 10 * seq.index + k)
        return sampled

    def take_logprobs(self) -> dict[int, TokenLogprobs]:
        return self._last


def make_engine(runner=None, **config) -> EngineCore:
    values = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=BLOCK_SIZE,
                  num_kvcache_blocks=32)
    values.update(config)
    return EngineCore(SchedulerConfig(**values), runner or CompletionRunner(), (2,), 1000)


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**({"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True} | overrides))


def run_all(engine: EngineCore, outputs: list[RequestOutput] | None = None) -> list[RequestOutput]:
    outputs = [] if outputs is None else outputs
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not finish")


def step_until_all_run(engine: EngineCore, n: int) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(50):
        outputs += engine.step()
        if {o.index for o in outputs} == set(range(n)):
            return outputs
    raise AssertionError("not every completion got a token")


def by_index(outputs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    grouped = defaultdict(list)
    for output in outputs:
        grouped[output.index].append(output)
    return grouped


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def expected_tokens(index: int, count: int = MAX_TOKENS) -> list[int]:
    return [100 + 10 * index + k for k in range(count)]


# Abort one completion


def test_aborting_one_completion_frees_its_blocks_and_its_siblings_finish_whole():
    runner = CompletionRunner()
    engine = make_engine(runner)
    engine.add_request("r", PROMPT, greedy(n=3))
    outputs = step_until_all_run(engine, 3)
    seqs = {seq.index: seq for seq in engine._live["r"]}
    block_manager = engine.scheduler.block_manager
    shared = seqs[0].block_table[:2]  # the prompt's full blocks, held by all three
    own = [b for b in seqs[1].block_table if b not in shared]
    assert seqs[1].block_table[:2] == shared and [block_manager.ref_counts[b] for b in shared] == [3, 3]
    used = block_manager.num_used_blocks

    assert engine.abort_completion("r", 1)
    assert [block_manager.ref_counts[b] for b in shared] == [2, 2]
    assert all(block_manager.ref_counts[b] == 0 for b in own)
    assert block_manager.num_used_blocks == used - len(own)
    samples_at_abort = runner.samples[1]
    aborted = engine.step()
    [report] = [o for o in aborted if o.index == 1]
    assert report.finish_reason == FinishReason.ABORTED and not report.request_finished and not report.new_token_ids

    outputs = run_all(engine, outputs + aborted)
    grouped = by_index(outputs)
    for index in (0, 2):
        assert tokens(grouped[index]) == expected_tokens(index)
        assert grouped[index][-1].finish_reason == FinishReason.LENGTH
    assert runner.samples[1] == samples_at_abort  # nothing sampled for it after the abort
    assert [o.request_finished for o in outputs].count(True) == 1 and outputs[-1].request_finished
    assert block_manager.num_used_blocks == 0 and not any(block_manager.ref_counts)
    engine.add_request("r", PROMPT, greedy())  # the id is free once the last completion ended


def test_the_request_id_stays_in_use_until_its_last_completion_ends():
    engine = make_engine()
    engine.add_request("r", PROMPT, greedy(n=2))
    step_until_all_run(engine, 2)
    engine.abort_completion("r", 0)
    engine.step()
    assert "r" in engine._live
    assert engine.abort_completion("r", 1)
    [last] = engine.step()
    assert last.index == 1 and last.finish_reason == FinishReason.ABORTED and last.request_finished
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_aborting_a_completion_is_idempotent_and_ignores_unknown_ones():
    engine = make_engine()
    engine.add_request("r", PROMPT, greedy(n=2))
    step_until_all_run(engine, 2)
    assert engine.abort_completion("r", 1)
    assert not engine.abort_completion("r", 1)
    assert not engine.abort_completion("r", 2)
    assert not engine.abort_completion("nobody", 0)
    outputs = run_all(engine)
    assert [o.index for o in outputs if o.finish_reason == FinishReason.ABORTED] == [1]


def test_aborting_the_completion_that_computes_the_prompt_hands_it_to_a_sibling():
    runner = CompletionRunner()
    engine = make_engine(runner)
    engine.add_request("r", PROMPT, greedy(n=3))
    assert engine.abort_completion("r", 0)  # before any step: the siblings wait for completion 0's prompt
    grouped = by_index(run_all(engine))
    assert grouped[0][-1].finish_reason == FinishReason.ABORTED and runner.samples[0] == 0
    for index in (1, 2):
        assert tokens(grouped[index]) == expected_tokens(index)
    assert engine.stats().num_cached_prompt_tokens == 8  # completion 2 still shares the prompt's 2 full blocks


def test_aborting_a_waiting_sibling_leaves_the_others_running():
    engine = make_engine()
    engine.add_request("r", PROMPT, greedy(n=3))
    assert engine.abort_completion("r", 2)
    grouped = by_index(run_all(engine))
    assert [o.finish_reason for o in grouped[2]] == [FinishReason.ABORTED]
    assert tokens(grouped[0]) == expected_tokens(0) and tokens(grouped[1]) == expected_tokens(1)


def test_aborting_the_request_after_one_completion_reports_each_remaining_one_once():
    engine = make_engine()
    engine.add_request("r", PROMPT, greedy(n=3))
    step_until_all_run(engine, 3)
    engine.abort_completion("r", 1)
    engine.abort_request("r")
    final = engine.step()
    assert sorted(o.index for o in final) == [0, 1, 2]
    assert [o.request_finished for o in final] == [False, False, True]
    assert not engine.has_unfinished_requests()


# best_of


LOGPROBS = {0: [-1.0] * MAX_TOKENS, 1: [-0.1] * MAX_TOKENS, 2: [-3.0] * MAX_TOKENS, 3: [-0.5] * MAX_TOKENS}


def test_best_of_holds_everything_back_then_releases_the_n_best_ranked_whole():
    runner = CompletionRunner(LOGPROBS)
    engine = make_engine(runner)
    engine.add_request("r", PROMPT, greedy(n=2, best_of=4))
    outputs = []
    while engine.has_unfinished_requests():
        step = engine.step()
        assert not step or not engine.has_unfinished_requests()  # nothing before the last completion ended
        outputs += step
    assert [o.index for o in outputs] == [0, 1]
    assert [tokens([o]) for o in outputs] == [expected_tokens(1), expected_tokens(3)]  # -0.6 and -3.0 in all
    assert [o.finish_reason for o in outputs] == [FinishReason.LENGTH] * 2
    assert [o.request_finished for o in outputs] == [False, True]
    assert [o.logprobs for o in outputs] == [None, None]  # computed to rank only: the request asked for none
    assert runner.num_logprobs_seen == {0}  # best_of > n asks the runner for the sampled token's logprob
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_best_of_keeps_the_logprobs_a_request_asked_for():
    engine = make_engine(CompletionRunner(LOGPROBS))
    engine.add_request("r", PROMPT, greedy(n=1, best_of=3, num_logprobs=2))
    [output] = run_all(engine)
    assert output.index == 0 and tokens([output]) == expected_tokens(1)
    assert [p.logprob for p in output.logprobs] == LOGPROBS[1]


def test_best_of_equal_to_n_streams_as_plain_n():
    runner = CompletionRunner(LOGPROBS)
    engine = make_engine(runner)
    engine.add_request("r", PROMPT, greedy(n=2, best_of=2))
    first = []
    while not first:
        first = engine.step()
    assert len(first[0].new_token_ids) == 1  # streamed token by token, nothing held
    assert runner.num_logprobs_seen == {None}


def test_aborting_a_best_of_request_reports_n_empty_aborted_completions():
    engine = make_engine(CompletionRunner(LOGPROBS))
    engine.add_request("r", PROMPT, greedy(n=2, best_of=3))
    for _ in range(4):
        assert engine.step() == []
    assert not engine.abort_completion("r", 0)  # no completion of it is visible yet
    assert engine.abort_request("r")
    final = engine.step()
    assert [(o.index, o.finish_reason, o.new_token_ids, o.request_finished) for o in final] == [
        (0, FinishReason.ABORTED, [], False), (1, FinishReason.ABORTED, [], True)]
    assert not engine.has_unfinished_requests() and engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("n, best_of", [(2, 1), (3, 2), (1, 17)])
def test_best_of_out_of_range_is_refused_naming_the_field(n, best_of):
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(n=n, best_of=best_of)
    assert excinfo.value.field == "sampling.best_of"


def test_best_of_bounds_inclusive():
    SamplingParams(n=3, best_of=3)
    SamplingParams(n=1, best_of=16)

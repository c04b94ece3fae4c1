"""EngineCore: admission and validation, the step loop's outputs, abort, and a cache too small for all."""

from collections import defaultdict

import pytest

from services.engine.core.config import SchedulerConfig
from services.engine.core.engine import EngineCore
from services.engine.core.errors import DuplicateRequestError, InvalidRequestError, QueueFullError
from services.engine.core.interfaces import RequestOutput, SchedulerOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import FinishReason

BLOCK_SIZE = 4
VOCAB_SIZE = 1000
EOS_IDS = (2, 3)


class ScriptedRunner:
    """Fake model runner: samples `scripts[request_id][sample_index]`, else a token derived from both."""

    def __init__(self, scripts: dict[str, list[int]] | None = None):
        self.scripts = scripts or {}
        self.batches: list[tuple[bool, list[tuple[str, int]]]] = []
        self.sample_indices: dict[str, list[int]] = defaultdict(list)

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        self.batches.append((batch.is_prefill, [(s.request_id, s.num_scheduled_tokens) for s in batch.seqs]))
        sampled: list[int | None] = []
        for seq in batch.seqs:
            if seq.num_cached_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                sampled.append(None)
                continue
            index = seq.num_completion_tokens
            self.sample_indices[seq.request_id].append(index)
            script = self.scripts.get(seq.request_id)
            sampled.append(script[index] if script else 100 + 10 * index + len(seq.request_id))
        return sampled


def make_engine(runner: ScriptedRunner | None = None, **config) -> EngineCore:
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=BLOCK_SIZE,
                    num_kvcache_blocks=32)
    defaults.update(config)
    return EngineCore(SchedulerConfig(**defaults), runner or ScriptedRunner(), EOS_IDS, VOCAB_SIZE)


def prompt(num_tokens: int, start: int = 10) -> list[int]:
    return list(range(start, start + num_tokens))


def run_all(engine: EngineCore, max_steps: int = 500) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for output in engine.step():
            outputs[output.request_id].append(output)
    raise AssertionError(f"engine did not finish within {max_steps} steps")


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [token_id for output in outputs for token_id in output.new_token_ids]


# Step outputs


def test_each_step_reports_one_token_per_request_and_the_finish_on_the_last():
    engine = make_engine(ScriptedRunner({"a": [50, 51, 52], "b": [60, 61, 62]}))
    engine.add_request("a", prompt(5), SamplingParams(max_tokens=3))
    engine.add_request("b", prompt(6, 40), SamplingParams(max_tokens=3))
    steps = [engine.step() for _ in range(3)]
    assert [[o.new_token_ids for o in outputs] for outputs in steps] == [[[50], [60]], [[51], [61]], [[52], [62]]]
    assert [o.finish_reason for o in steps[1]] == [None, None]
    assert [o.finish_reason for o in steps[2]] == [FinishReason.LENGTH] * 2
    assert [(o.num_prompt_tokens, o.num_completion_tokens) for o in steps[2]] == [(5, 3), (6, 3)]
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_sample_index_is_num_completion_tokens():
    runner = ScriptedRunner()
    engine = make_engine(runner)
    engine.add_request("a", prompt(3), SamplingParams(max_tokens=4))
    run_all(engine)
    assert runner.sample_indices["a"] == [0, 1, 2, 3]


def test_mid_prefill_steps_output_nothing():
    engine = make_engine(max_num_batched_tokens=4)
    engine.add_request("a", prompt(10), SamplingParams(max_tokens=2))
    assert engine.step() == [] and engine.step() == []
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["a"] and len(outputs[0].new_token_ids) == 1


def test_second_eos_id_finishes_with_stop_and_is_the_matched_stop_token():
    engine = make_engine(ScriptedRunner({"a": [50, 3, 51]}))
    engine.add_request("a", prompt(4), SamplingParams(max_tokens=3))
    outputs = run_all(engine)["a"]
    assert tokens_of(outputs) == [50, 3]
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].matched_stop_token_id == 3
    assert [o.matched_stop_token_id for o in outputs[:-1]] == [None]


def test_matched_stop_token_id_is_unset_unless_the_finish_is_stop():
    engine = make_engine(ScriptedRunner({"a": [50, 51], "b": [77, 60, 61, 62, 63]}))
    engine.add_request("a", prompt(4), SamplingParams(max_tokens=2))
    engine.add_request("b", prompt(4, 40), SamplingParams(max_tokens=5, stop_token_ids=[77], min_tokens=1))
    engine.add_request("c", prompt(4, 80), SamplingParams(max_tokens=5))
    first = {o.request_id: o for o in engine.step()}
    engine.abort_request("c")
    outputs = run_all(engine)
    assert first["b"].new_token_ids == [77] and first["b"].matched_stop_token_id is None
    assert outputs["a"][-1].finish_reason == FinishReason.LENGTH and outputs["a"][-1].matched_stop_token_id is None
    assert outputs["c"][-1].finish_reason == FinishReason.ABORTED and outputs["c"][-1].matched_stop_token_id is None
    # 77 came before min_tokens: not a stop, so b runs on to its max_tokens.
    assert outputs["b"][-1].finish_reason == FinishReason.LENGTH and outputs["b"][-1].matched_stop_token_id is None


def test_stop_token_id_is_reported():
    engine = make_engine(ScriptedRunner({"a": [50, 77, 51]}))
    engine.add_request("a", prompt(4), SamplingParams(max_tokens=3, stop_token_ids=[77]))
    outputs = run_all(engine)["a"]
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].matched_stop_token_id == 77


def test_cached_tokens_report_prefix_hits():
    engine = make_engine()
    engine.add_request("first", prompt(12), SamplingParams(max_tokens=2))
    first = run_all(engine)["first"]
    engine.add_request("second", prompt(12), SamplingParams(max_tokens=2))
    second = run_all(engine)["second"]
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 8
    stats = engine.stats()
    assert stats.num_cached_prompt_tokens == 8 and stats.num_computed_prompt_tokens == 12 + 4
    assert stats.num_generated_tokens == 4


def test_stats_count_queues_and_blocks():
    engine = make_engine(max_num_seqs=1)
    engine.add_request("a", prompt(5), SamplingParams(max_tokens=4))
    engine.add_request("b", prompt(3, 50), SamplingParams(max_tokens=4))
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert (stats.num_used_blocks, stats.num_free_blocks, stats.num_total_blocks) == (2, 30, 32)


# Abort


def test_abort_waiting_request_reports_aborted_on_next_step():
    engine = make_engine()
    engine.add_request("a", prompt(4), SamplingParams())
    assert engine.abort_request("a")
    assert engine.has_unfinished_requests()  # its final output is still owed
    outputs = engine.step()
    assert len(outputs) == 1
    assert outputs[0].request_id == "a" and outputs[0].new_token_ids == []
    assert outputs[0].finish_reason == FinishReason.ABORTED
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_abort_running_request_frees_blocks_at_once():
    engine = make_engine()
    engine.add_request("a", prompt(9), SamplingParams(max_tokens=10))
    engine.add_request("b", prompt(4, 50), SamplingParams(max_tokens=3))
    engine.step()
    engine.abort_request("a")
    assert engine.stats().num_used_blocks == 1
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", FinishReason.ABORTED), ("b", None)]
    assert tokens_of(run_all(engine)["b"]) and engine.stats().num_used_blocks == 0


def test_abort_mid_prefill_frees_blocks():
    engine = make_engine(max_num_batched_tokens=4)
    engine.add_request("a", prompt(10), SamplingParams())
    engine.step()
    assert engine.stats().num_used_blocks == 3
    assert engine.abort_request("a")
    assert engine.stats().num_used_blocks == 0 and engine.stats().num_waiting == 0


def test_abort_is_idempotent():
    engine = make_engine()
    engine.add_request("a", prompt(4), SamplingParams())
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    assert not engine.abort_request("never-added")
    assert [o.finish_reason for o in engine.step()] == [FinishReason.ABORTED]
    assert engine.step() == []


def test_abort_after_finish_returns_false():
    engine = make_engine()
    engine.add_request("a", prompt(4), SamplingParams(max_tokens=1))
    assert engine.step()[0].finish_reason == FinishReason.LENGTH
    assert not engine.abort_request("a")


# Admission


@pytest.mark.parametrize(
    "prompt_token_ids, max_tokens, field",
    [
        ([], 4, "prompt_token_ids"),
        ([5, -1, 6], 4, "prompt_token_ids"),
        ([5, VOCAB_SIZE, 6], 4, "prompt_token_ids"),
        (prompt(65), 1, "prompt_token_ids"),
        (prompt(60), 5, "sampling.max_tokens"),
    ],
)
def test_invalid_request_is_rejected_with_its_field(prompt_token_ids, max_tokens, field):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("a", prompt_token_ids, SamplingParams(max_tokens=max_tokens))
    assert error.value.field == field
    assert not engine.has_unfinished_requests()


def test_invalid_sampling_params_are_rejected():
    sampling = SamplingParams()
    sampling.top_p = 0.0
    with pytest.raises(InvalidRequestError) as error:
        make_engine().add_request("a", prompt(4), sampling)
    assert error.value.field == "sampling.top_p"


def test_stop_token_id_outside_the_vocabulary_is_rejected():
    engine = make_engine()
    engine.add_request("ok", prompt(4), SamplingParams(stop_token_ids=[VOCAB_SIZE - 1]))
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("a", prompt(4), SamplingParams(stop_token_ids=[5, VOCAB_SIZE]))
    assert error.value.field == "sampling.stop_token_ids"


def test_prompt_and_max_tokens_exactly_at_max_model_len_are_admitted():
    engine = make_engine()
    engine.add_request("a", prompt(60), SamplingParams(max_tokens=4))
    engine.add_request("b", prompt(63, 100), SamplingParams(max_tokens=1))
    assert engine.stats().num_waiting == 2


@pytest.mark.parametrize("num_prompt_tokens, max_tokens, field",
                         [(8, 10, "sampling.max_tokens"), (17, 1, "prompt_token_ids")])
def test_request_that_can_never_fit_is_rejected_while_others_finish(num_prompt_tokens, max_tokens, field):
    engine = make_engine(num_kvcache_blocks=4)
    engine.add_request("ok", prompt(4), SamplingParams(max_tokens=5))
    engine.step()
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("huge", prompt(num_prompt_tokens, 50), SamplingParams(max_tokens=max_tokens))
    assert error.value.field == field
    outputs = run_all(engine)
    assert set(outputs) == {"ok"} and outputs["ok"][-1].num_completion_tokens == 5
    assert engine.stats().num_used_blocks == 0


def test_request_that_exactly_fills_the_cache_runs():
    engine = make_engine(num_kvcache_blocks=4)
    engine.add_request("full", prompt(8), SamplingParams(max_tokens=9))
    outputs = run_all(engine)["full"]
    assert len(tokens_of(outputs)) == 9 and outputs[-1].finish_reason == FinishReason.LENGTH


def test_duplicate_live_request_id_is_rejected():
    engine = make_engine()
    engine.add_request("a", prompt(4), SamplingParams(max_tokens=1))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", prompt(4), SamplingParams())
    run_all(engine)
    engine.add_request("a", prompt(4), SamplingParams(max_tokens=1))
    assert engine.has_unfinished_requests()


def test_aborted_request_id_is_in_use_until_reported():
    engine = make_engine()
    engine.add_request("a", prompt(4), SamplingParams())
    engine.abort_request("a")
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", prompt(4), SamplingParams())
    engine.step()
    engine.add_request("a", prompt(4), SamplingParams())


def test_full_waiting_queue_rejects_new_requests():
    engine = make_engine(max_waiting=2)
    engine.add_request("a", prompt(4), SamplingParams())
    engine.add_request("b", prompt(4, 50), SamplingParams())
    with pytest.raises(QueueFullError):
        engine.add_request("c", prompt(4, 80), SamplingParams())
    engine.step()
    engine.add_request("c", prompt(4, 80), SamplingParams())
    assert engine.stats().num_waiting == 1


@pytest.mark.parametrize("config", [dict(num_kvcache_blocks=0), dict(max_num_seqs=0), dict(max_num_batched_tokens=0)],
                         ids=str)
def test_engine_rejects_a_config_without_room_for_one_step(config):
    with pytest.raises(ValueError):
        make_engine(**config)


def test_the_smallest_budgets_still_run():
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=1, num_kvcache_blocks=2)
    engine.add_request("a", prompt(3), SamplingParams(max_tokens=2))
    assert len(tokens_of(run_all(engine)["a"])) == 2


def test_a_waiting_queue_of_one():
    engine = make_engine(max_waiting=1)
    engine.add_request("a", prompt(4), SamplingParams())
    with pytest.raises(QueueFullError):
        engine.add_request("b", prompt(4, 50), SamplingParams())


def test_a_prompt_that_fills_the_cache_alone_blames_max_tokens():
    engine = make_engine(num_kvcache_blocks=4)
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("a", prompt(16), SamplingParams(max_tokens=2))
    assert error.value.field == "sampling.max_tokens"
    assert error.value.description == "needs 17 tokens of KV cache but it holds only 16"

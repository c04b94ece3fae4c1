"""EngineCore over a fake runner that keeps a fake KV cache: block bookkeeping errors change the outputs.

The runner writes each computed token id into the cache slot its block table gives, and samples from what it
reads back over the whole context, as attention would. A block shared wrongly, a prefix hit on the wrong
block, a preempted sequence not recomputed or a table pointing at freed blocks all show up as a context that
differs from the sequence's own tokens.
"""

import pytest

from services.engine.core.interfaces import SchedulerOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import FinishReason
from tests.unit.test_engine_core import BLOCK_SIZE, make_engine, prompt, run_all, tokens_of


class KVRunner:
    """Fake runner with a slot-addressed token store standing in for the KV cache."""

    def __init__(self, block_size: int = BLOCK_SIZE):
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id whose "KV" it holds
        self.mismatches: list[tuple[str, int]] = []  # (request id, context length) where the cache was wrong

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        sampled: list[int | None] = []
        for seq in batch.seqs:
            end = seq.num_cached_tokens + seq.num_scheduled_tokens
            for position in range(seq.num_cached_tokens, end):
                self.slots[self._slot(seq.block_table, position)] = seq.token_ids[position]
            if end < seq.num_tokens:
                sampled.append(None)
                continue
            context = [self.slots.get(self._slot(seq.block_table, position)) for position in range(end)]
            if context != seq.token_ids[:end]:
                self.mismatches.append((seq.request_id, end))
            sampled.append(100 + hash(tuple(context)) % 800)  # never an EOS id
        return sampled

    def _slot(self, block_table: list[int], position: int) -> tuple[int, int]:
        return block_table[position // self.block_size], position % self.block_size


def run(num_kvcache_blocks: int, prompts: list[list[int]], max_tokens: int = 8, **config):
    runner = KVRunner()
    engine = make_engine(runner, num_kvcache_blocks=num_kvcache_blocks, **config)
    for index, ids in enumerate(prompts):
        engine.add_request(f"r{index}", ids, SamplingParams(max_tokens=max_tokens))
    outputs = run_all(engine)
    return {rid: tokens_of(outs) for rid, outs in outputs.items()}, engine, runner


def test_the_fake_cache_catches_a_wrong_block_table():
    runner = KVRunner()
    engine = make_engine(runner)
    engine.add_request("a", prompt(6), SamplingParams(max_tokens=3))
    engine.step()
    seq = engine.scheduler.running[0]
    seq.block_table[0], seq.block_table[1] = seq.block_table[1], seq.block_table[0]
    engine.step()
    assert runner.mismatches == [("a", 7)]


def test_preemption_keeps_every_output_the_same():
    prompts = [prompt(5 + index, 20 * index) for index in range(4)]
    expected, roomy, roomy_runner = run(64, prompts, max_num_batched_tokens=8)
    actual, tight, tight_runner = run(6, prompts, max_num_batched_tokens=8)
    assert roomy.stats().num_preemptions == 0 and tight.stats().num_preemptions > 0
    assert roomy_runner.mismatches == [] and tight_runner.mismatches == []
    assert actual == expected and all(len(tokens) == 8 for tokens in actual.values())
    assert tight.stats().num_used_blocks == 0


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_shared_prefixes_read_the_right_blocks(enable_prefix_caching):
    shared = prompt(9)
    prompts = [shared + [70 + index] * (index + 1) for index in range(4)] + [shared]
    runner = KVRunner()
    engine = make_engine(runner, num_kvcache_blocks=32, enable_prefix_caching=enable_prefix_caching)
    engine.add_request("r0", prompts[0], SamplingParams(max_tokens=6))
    first = engine.step()  # r0's prompt blocks are computed and hashed before the others arrive
    for index, ids in enumerate(prompts[1:], start=1):
        engine.add_request(f"r{index}", ids, SamplingParams(max_tokens=6))
    cached = {rid: tokens_of(outs) for rid, outs in run_all(engine).items()}
    cached["r0"] = first[0].new_token_ids + cached["r0"]
    fresh = {}
    for index, ids in enumerate(prompts):  # each alone, on a fresh engine: no cache to share
        alone, _, alone_runner = run(32, [ids], max_tokens=6, enable_prefix_caching=False)
        assert alone_runner.mismatches == []
        fresh[f"r{index}"] = alone["r0"]
    assert runner.mismatches == [] and cached == fresh
    assert engine.stats().num_cached_prompt_tokens == (4 * 8 if enable_prefix_caching else 0)


def test_aborted_then_resubmitted_prompt_reuses_only_valid_blocks():
    runner = KVRunner()
    engine = make_engine(runner, num_kvcache_blocks=8)
    engine.add_request("a", prompt(10), SamplingParams(max_tokens=8))
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.add_request("b", prompt(10), SamplingParams(max_tokens=8))
    engine.add_request("c", prompt(12, 300), SamplingParams(max_tokens=8))
    outputs = run_all(engine)
    assert runner.mismatches == []
    assert outputs["a"][-1].finish_reason == FinishReason.ABORTED
    assert len(tokens_of(outputs["b"])) == len(tokens_of(outputs["c"])) == 8


def test_a_block_still_shared_is_not_handed_out_when_one_holder_finishes():
    runner = KVRunner()
    engine = make_engine(runner, num_kvcache_blocks=8)
    engine.add_request("a", prompt(9), SamplingParams(max_tokens=2))
    engine.step()
    engine.add_request("b", prompt(8) + [99], SamplingParams(max_tokens=6))  # shares a's two full blocks
    engine.step()
    engine.step()  # a finishes and lets go of the shared blocks; b still reads them
    engine.add_request("c", prompt(20, 200), SamplingParams(max_tokens=1))  # takes every block left
    outputs = run_all(engine)
    assert runner.mismatches == []
    assert outputs["b"][-1].num_completion_tokens == 6 and len(tokens_of(outputs["c"])) == 1

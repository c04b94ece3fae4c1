"""sampling.n through both real services: messages tagged with their completion's index, one final message per
completion (its own finish reason), the prompt prefilled once, a cancel frees every block, bounds refused."""

from __future__ import annotations

import grpc
import pytest

from llmserve import FinishReason
from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2
from llmserve.textgen.v1 import textgen_pb2
from tests.services.helpers import engine_load, field_violations, wait_engine_idle
from tests.services.test_generation import pick_stop_string

pytestmark = pytest.mark.slow

CALL_TIMEOUT_S = 120
N = 3
STOP_PROMPT = "Write a short story about a lighthouse keeper."
STOP_MAX_TOKENS = 48


def _greedy(max_tokens: int, n: int = N) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def _by_index(responses) -> dict[int, list]:
    grouped: dict[int, list] = {}
    for response in responses:
        grouped.setdefault(response.index, []).append(response)
    return grouped


def _check_one_final_per_index(responses) -> None:
    for messages in _by_index(responses).values():
        reasons = [m.finish_reason for m in messages]
        assert reasons[-1] != common_pb2.FINISH_REASON_UNSPECIFIED
        assert all(r == common_pb2.FINISH_REASON_UNSPECIFIED for r in reasons[:-1])


def test_engine_streams_n_completions_sharing_the_prompt(engine_stub, offline, idle_engine):
    block_size = engine_stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest()).block_size
    prompt = [1000 + (i * 7) % 5000 for i in range(2 * block_size + 3)]  # 2 full blocks + a partial one
    before = engine_load(engine_stub)
    request = engine_pb2.GenerateRequest(request_id="n-engine", prompt_token_ids=prompt, sampling=_greedy(4))
    responses = list(engine_stub.Generate(request, timeout=CALL_TIMEOUT_S))
    grouped = _by_index(responses)
    assert sorted(grouped) == list(range(N))
    _check_one_final_per_index(responses)
    [reference] = offline.generate([prompt], temperature=0.0, max_tokens=4, ignore_eos=True)
    for messages in grouped.values():
        assert [t for m in messages for t in m.token_ids] == reference["token_ids"]
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    after = wait_engine_idle(engine_stub)
    # completion 0 computes the prompt; the other N-1 hit the prefix cache for both full blocks
    assert after.num_cached_prompt_tokens - before.num_cached_prompt_tokens >= (N - 1) * 2 * block_size
    assert after.num_finished_requests - before.num_finished_requests == 1


def test_textgen_streams_n_texts_each_with_its_finish(textgen_stub, offline, idle_engine):
    prompt = "The capital of France is"
    request = textgen_pb2.GenerateRequest(text=prompt, sampling=_greedy(5))
    responses = list(textgen_stub.Generate(request, timeout=CALL_TIMEOUT_S))
    grouped = _by_index(responses)
    assert sorted(grouped) == list(range(N))
    _check_one_final_per_index(responses)
    [reference] = offline.generate([prompt], temperature=0.0, max_tokens=5, ignore_eos=True)
    for messages in grouped.values():
        assert "".join(m.text for m in messages) == reference["text"]
        assert messages[-1].usage.completion_tokens == 5
    assert responses[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


def test_cancel_mid_stream_frees_every_completions_blocks(engine_stub, idle_engine):
    request = engine_pb2.GenerateRequest(request_id="n-cancel", prompt_token_ids=list(range(10, 60)),
                                         sampling=_greedy(500, n=4))
    call = engine_stub.Generate(request, timeout=CALL_TIMEOUT_S)
    seen = set()
    for response in call:
        seen.add(response.index)
        if len(seen) == 4:
            break
    assert engine_load(engine_stub).num_used_blocks > 0
    call.cancel()
    assert wait_engine_idle(engine_stub).num_used_blocks == 0


def _stop_in_second_completion_only(offline) -> tuple[int, list[dict], tuple[str, int, int]]:
    """(seed, the two completions' references, a stop string of completion 1 absent from completion 0's text).

    With seed s, completion i samples as an n = 1 request with seed s + i, so the references are two seeded
    n = 1 runs; the first seed whose completion 1 has a stop string completion 0 never produces is taken."""
    for seed in range(10):
        references = [offline.generate([STOP_PROMPT], temperature=1.0, top_p=1.0, seed=seed + i,
                                       max_tokens=STOP_MAX_TOKENS, ignore_eos=True)[0] for i in range(2)]
        stop = pick_stop_string(offline.tokenizer, references[1]["token_ids"])
        if stop[0] not in references[0]["text"]:
            return seed, references, stop
    raise AssertionError("no seed gave completion 1 a stop string that completion 0 lacks")


def test_a_stop_string_ends_one_completion_in_the_engine_and_its_sibling_runs_on(client, offline, engine_stub,
                                                                                  idle_engine):
    seed, references, (stop, offset, completing_index) = _stop_in_second_completion_only(offline)
    before = engine_load(engine_stub)
    result = client.complete(STOP_PROMPT, n=2, temperature=1.0, top_p=1.0, seed=seed, max_tokens=STOP_MAX_TOKENS,
                             ignore_eos=True, stop=[stop], timeout=CALL_TIMEOUT_S)
    first, second = result.completions
    assert (first.index, first.finish_reason, first.text) == (0, FinishReason.LENGTH, references[0]["text"])
    assert first.token_ids == references[0]["token_ids"]
    assert (second.index, second.finish_reason, second.matched_stop_string) == (1, FinishReason.STOP, stop)
    assert second.text == references[1]["text"][:offset]
    assert second.token_ids == references[1]["token_ids"][: completing_index + 1]
    after = wait_engine_idle(engine_stub)
    # Completion 0 generates all STOP_MAX_TOKENS; completion 1 runs past its stop only until the tokenizer
    # service's Abort naming (request, 1) lands. Without that abort the engine would generate 2 * STOP_MAX_TOKENS.
    num_generated = after.num_generated_tokens - before.num_generated_tokens
    assert STOP_MAX_TOKENS + completing_index < num_generated < 2 * STOP_MAX_TOKENS
    assert after.num_finished_requests - before.num_finished_requests == 1


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_invalid_argument_at_both_services(textgen_stub, engine_stub, n, idle_engine):
    public = textgen_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=2, n=n))
    internal = engine_pb2.GenerateRequest(request_id="n-bad", prompt_token_ids=[10, 11],
                                          sampling=common_pb2.SamplingParams(max_tokens=2, n=n))
    for call in (lambda: list(textgen_stub.Generate(public, timeout=CALL_TIMEOUT_S)),
                 lambda: list(engine_stub.Generate(internal, timeout=CALL_TIMEOUT_S))):
        with pytest.raises(grpc.RpcError) as excinfo:
            call()
        assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(excinfo.value) == ["sampling.n"]

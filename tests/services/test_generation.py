"""Generation through both real services: equality with the offline engine, concurrency, stop strings."""

from __future__ import annotations

import asyncio

import pytest

from llmserve import AsyncLLMServeClient, FinishReason, LLMServeClient
from tests.services.helpers import engine_load, wait_engine_idle

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Translate to English: 你好，世界 🌍 means",
]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the capital of Japan?"}]
MAX_TOKENS = 24
CALL_TIMEOUT_S = 120
STOP_MAX_TOKENS = 500
FINISH_REASONS = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP}


def stream_deltas(client: LLMServeClient, prompt=None, **options):
    """(every text delta as it arrived, the final result)."""
    stream = client.generate(prompt, timeout=CALL_TIMEOUT_S, **options)
    deltas = list(stream)
    return deltas, stream.result()


def assert_timed(result) -> None:
    """The last message carries the tokenizer service's own timing."""
    timing = result.timing
    assert timing is not None and timing.arrival_time is not None
    assert 0 < timing.time_to_first_token_s <= timing.total_s


def assert_same_as_offline(deltas: list[str], result, reference: dict, num_prompt_tokens: int) -> None:
    assert "".join(deltas) == result.text == reference["text"]
    assert result.token_ids == reference["token_ids"]
    assert result.finish_reason == FINISH_REASONS[reference["finish_reason"]]
    assert result.usage.prompt_tokens == num_prompt_tokens
    assert result.usage.completion_tokens == len(result.token_ids)
    assert_timed(result)


def test_greedy_text_prompts_stream_the_offline_output(client, offline, idle_engine):
    references = offline.generate(PROMPTS, temperature=0.0, max_tokens=MAX_TOKENS)
    for prompt, reference in zip(PROMPTS, references):
        deltas, result = stream_deltas(client, prompt, temperature=0.0, max_tokens=MAX_TOKENS)
        assert_same_as_offline(deltas, result, reference, len(offline.tokenizer.encode(prompt)))
        assert len(deltas) > 1, "the text arrived in one piece: not streamed"
        assert all("\ufffd" not in delta for delta in deltas[:-1]), deltas
        assert client.detokenize(result.token_ids) == result.text


def test_greedy_chat_streams_the_offline_chat_output(client, offline, idle_engine):
    reference = offline.chat(CHAT, temperature=0.0, max_tokens=MAX_TOKENS)
    deltas, result = stream_deltas(client, messages=CHAT, temperature=0.0, max_tokens=MAX_TOKENS)
    assert_same_as_offline(deltas, result, reference, len(offline.chat_prompt_ids(CHAT)))


def test_token_id_prompt_gives_the_text_prompts_output(client, offline, idle_engine):
    prompt = PROMPTS[0]
    prompt_ids = offline.tokenizer.encode(prompt)
    from_text = client.complete(prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                timeout=CALL_TIMEOUT_S)
    from_ids = client.complete(prompt_ids, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              timeout=CALL_TIMEOUT_S)
    assert from_ids.token_ids == from_text.token_ids and from_ids.text == from_text.text
    assert from_ids.usage.prompt_tokens == from_text.usage.prompt_tokens == len(prompt_ids)
    assert from_ids.usage.completion_tokens == len(from_ids.token_ids) == MAX_TOKENS
    assert from_ids.finish_reason == FinishReason.LENGTH


def test_concurrent_streams_finish_with_their_exact_token_counts(stack, engine_stub, idle_engine):
    num_streams = 32
    max_tokens = [4 + i % 17 for i in range(num_streams)]  # 4..20
    before = engine_load(engine_stub)

    async def run_all():
        async with AsyncLLMServeClient(stack.tokenizer_target) as client:
            streams = [client.generate(f"Story number {i}: once upon a time", max_tokens=n, ignore_eos=True,
                                       temperature=0.8, seed=i, timeout=240) for i, n in enumerate(max_tokens)]
            return await asyncio.wait_for(asyncio.gather(*(stream.result() for stream in streams)), timeout=240)

    results = asyncio.run(run_all())
    for n, result in zip(max_tokens, results):
        assert result.finish_reason == FinishReason.LENGTH
        assert len(result.token_ids) == result.usage.completion_tokens == n
    assert len({result.request_id for result in results}) == num_streams
    after = wait_engine_idle(engine_stub)
    assert after.num_generated_tokens - before.num_generated_tokens == sum(max_tokens)
    assert after.num_finished_requests - before.num_finished_requests == num_streams


def pick_stop_string(tokenizer, token_ids: list[int]) -> tuple[str, int, int]:
    """(stop string spanning a token boundary, its offset in the text, index of the token that completes it).

    Two characters from each side of a boundary near the middle, so the string starts inside one token and
    ends inside the next; it must first occur at that boundary.
    """
    prefixes = [tokenizer.decode(token_ids[:i], skip_special_tokens=True) for i in range(len(token_ids) + 1)]
    text = prefixes[-1]
    middle = len(token_ids) // 2
    for i in sorted(range(1, len(token_ids) - 1), key=lambda i: abs(i - middle)):
        before, after = prefixes[i][len(prefixes[i - 1]):], prefixes[i + 1][len(prefixes[i]):]
        if len(before.strip()) < 2 or len(after.strip()) < 2 or not (before + after).isascii():
            continue
        stop, offset = before[-2:] + after[:2], len(prefixes[i]) - 2
        if text.startswith(prefixes[i + 1]) and text.find(stop) == offset:
            return stop, offset, i
    raise AssertionError(f"no token boundary to put a stop string on in {text!r}")


@pytest.mark.parametrize("include", [False, True], ids=["exclude", "include"])
def test_stop_string_ends_the_text_and_the_engine_request(client, offline, engine_stub, idle_engine, include):
    prompt = PROMPTS[0]
    [reference] = offline.generate([prompt], temperature=0.0, max_tokens=32, ignore_eos=True)
    stop, offset, completing_index = pick_stop_string(offline.tokenizer, reference["token_ids"])
    expected = reference["text"][: offset + len(stop) if include else offset]
    before = engine_load(engine_stub)
    # max_tokens far beyond the stop: if the tokenizer service did not cancel the engine call, the engine would
    # run the request to max_tokens (or still be running at the idle deadline below), however fast it is.
    deltas, result = stream_deltas(client, prompt, temperature=0.0, max_tokens=STOP_MAX_TOKENS, ignore_eos=True,
                                   stop=[stop], include_stop_str_in_output=include)
    assert "".join(deltas) == result.text == expected
    assert result.finish_reason == FinishReason.STOP
    assert result.matched_stop_string == stop and result.matched_stop_token_id is None
    assert result.token_ids == reference["token_ids"][: completing_index + 1]
    assert_timed(result)
    after = wait_engine_idle(engine_stub)
    num_generated = after.num_generated_tokens - before.num_generated_tokens
    assert completing_index < num_generated < STOP_MAX_TOKENS
    assert after.num_finished_requests - before.num_finished_requests == 1


def test_callers_request_ids_need_not_be_unique(stack, client, engine_stub, idle_engine):
    """The public request_id is the caller's label, echoed back; two callers may pick the same one."""

    async def run_both():
        async with AsyncLLMServeClient(stack.tokenizer_target) as async_client:
            streams = [async_client.generate(f"Tell me about number {i}", max_tokens=8, ignore_eos=True,
                                             request_id="same-id", timeout=CALL_TIMEOUT_S) for i in range(2)]
            return await asyncio.wait_for(asyncio.gather(*(stream.result() for stream in streams)), timeout=120)

    for result in asyncio.run(run_both()):
        assert result.request_id == "same-id" and len(result.token_ids) == 8
    cancelled = client.generate(PROMPTS[0], max_tokens=200, ignore_eos=True, request_id="retried",
                                timeout=CALL_TIMEOUT_S)
    next(iter(cancelled))
    cancelled.cancel()
    retry = client.complete(PROMPTS[0], max_tokens=4, ignore_eos=True, request_id="retried",
                            timeout=CALL_TIMEOUT_S)
    assert retry.request_id == "retried" and len(retry.token_ids) == 4
    wait_engine_idle(engine_stub)

"""A cancelled stream, an expired deadline and a killed client each free the sequence's KV blocks."""

from __future__ import annotations

import re
import sys

import grpc
import pytest

from llmserve import FinishReason, LLMServeError
from llmserve.textgen.v1 import textgen_pb2
from tests.services.helpers import engine_load, wait_engine_idle
from tests.services.procs import LoggedProcess

pytestmark = pytest.mark.slow

PROMPT = "Count slowly from one to one thousand:"
# Far more tokens than the engine makes before the idle deadline (about 15 tokens/s on 2 CPU cores), so a
# request that was not aborted is still running when wait_engine_idle gives up.
LONG_MAX_TOKENS = 500
NUM_MESSAGES_BEFORE = 3


def long_request() -> textgen_pb2.GenerateRequest:
    request = textgen_pb2.GenerateRequest(text=PROMPT)
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    request.sampling.max_tokens = LONG_MAX_TOKENS
    return request


def assert_freed_and_still_working(client, engine_stub, before) -> None:
    """The engine is idle with every block free, counted one more finished request, and serves the next one."""
    after = wait_engine_idle(engine_stub)
    assert after.num_finished_requests - before.num_finished_requests == 1
    assert after.num_generated_tokens - before.num_generated_tokens < LONG_MAX_TOKENS
    result = client.complete(PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True, timeout=60)
    assert result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == 8


def test_cancelled_stream_frees_its_blocks(client, textgen_stub, engine_stub, idle_engine):
    before = idle_engine
    call = textgen_stub.Generate(long_request(), timeout=120)
    for _, _response in zip(range(NUM_MESSAGES_BEFORE), call):
        pass
    assert engine_load(engine_stub).num_used_blocks > 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert_freed_and_still_working(client, engine_stub, before)


def test_deadline_mid_generation_frees_its_blocks(client, engine_stub, idle_engine):
    before = idle_engine
    deltas = []
    with pytest.raises(LLMServeError) as caught:
        for delta in client.generate(PROMPT, temperature=0.0, max_tokens=LONG_MAX_TOKENS, ignore_eos=True,
                                     timeout=3.0):
            deltas.append(delta)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert deltas, "the deadline expired before generation started; nothing was cut mid-way"
    assert_freed_and_still_working(client, engine_stub, before)


def test_killed_client_process_frees_its_blocks(stack, client, engine_stub, idle_engine):
    before = idle_engine
    client_process = LoggedProcess("stream-client", [sys.executable, "-m", "tests.services.stream_client",
                                                     stack.tokenizer_target, PROMPT, str(LONG_MAX_TOKENS)])
    try:
        client_process.wait_line(re.compile(rf"^message {NUM_MESSAGES_BEFORE} "), timeout_s=60)
        assert engine_load(engine_stub).num_running == 1
    finally:
        client_process.kill()
    assert client_process.proc.returncode == -9
    assert "finished" not in client_process.lines
    assert_freed_and_still_working(client, engine_stub, before)

"""A cancelled stream, an expired deadline and a killed client each free the sequence's KV blocks within a step.

The engine core is paused (tests/services/engine_pause.py) while the client goes away, so the stream is
cut mid-generation whatever the machine's speed, and the steps run after the abort come from the engine's
own counters.
"""

from __future__ import annotations

import re
import sys

import grpc
import pytest

from llmserve import FinishReason, LLMServeError
from llmserve.textgen.v1 import textgen_pb2
from tests.services.engine_pause import (
    assert_freed_within_steps, engine_core_pid, paused, wait_requests_finished)
from tests.services.helpers import wait_engine_idle
from tests.services.procs import LoggedProcess

pytestmark = pytest.mark.slow

PROMPT = "Count slowly from one to one thousand:"
LONG_MAX_TOKENS = 500  # never reached: each test ends its request after a few messages
NUM_MESSAGES_BEFORE = 3
# Deadlines tried in turn until one leaves time for a first token (a loaded machine may need a long one);
# once the first token is in, the engine is paused, so the deadline always expires mid-generation.
DEADLINES_S = (2.0, 8.0, 32.0, 120.0)


def long_request() -> textgen_pb2.GenerateRequest:
    request = textgen_pb2.GenerateRequest(text=PROMPT)
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    request.sampling.max_tokens = LONG_MAX_TOKENS
    return request


def assert_still_working(client) -> None:
    result = client.complete(PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True, timeout=60)
    assert result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == 8


def test_cancelled_stream_frees_its_blocks(stack, client, textgen_stub, engine_stub, idle_engine):
    call = textgen_stub.Generate(long_request(), timeout=120)
    for _, _response in zip(range(NUM_MESSAGES_BEFORE), call):
        pass
    with paused(engine_core_pid(stack.engine.proc.pid)):
        call.cancel()
        with pytest.raises(grpc.RpcError) as caught:
            next(call)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
        at_abort = wait_requests_finished(engine_stub, idle_engine.num_finished_requests + 1)
    assert_freed_within_steps(engine_stub, at_abort)
    assert_still_working(client)


def test_deadline_mid_generation_frees_its_blocks(stack, client, engine_stub, idle_engine):
    num_finished = idle_engine.num_finished_requests
    for deadline_s in DEADLINES_S:
        deltas = iter(client.generate(PROMPT, temperature=0.0, max_tokens=LONG_MAX_TOKENS, ignore_eos=True,
                                      timeout=deadline_s))
        num_finished += 1
        try:
            next(deltas)
        except LLMServeError as error:  # the deadline came before the first token: try a longer one
            assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED, error
            wait_requests_finished(engine_stub, num_finished)
            wait_engine_idle(engine_stub)
            continue
        with paused(engine_core_pid(stack.engine.proc.pid)):
            with pytest.raises(LLMServeError) as caught:
                list(deltas)
            assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            at_abort = wait_requests_finished(engine_stub, num_finished)
        assert_freed_within_steps(engine_stub, at_abort)
        assert_still_working(client)
        return
    pytest.fail(f"no first token within {DEADLINES_S[-1]} s")


def test_killed_client_process_frees_its_blocks(stack, client, engine_stub, idle_engine):
    client_process = LoggedProcess("stream-client", [sys.executable, "-m", "tests.services.stream_client",
                                                     stack.tokenizer_target, PROMPT, str(LONG_MAX_TOKENS)])
    try:
        client_process.wait_line(re.compile(rf"^message {NUM_MESSAGES_BEFORE} "), timeout_s=60)
        with paused(engine_core_pid(stack.engine.proc.pid)):
            client_process.kill()
            at_abort = wait_requests_finished(engine_stub, idle_engine.num_finished_requests + 1)
    finally:
        client_process.kill()
    assert client_process.proc.returncode == -9
    assert "finished" not in client_process.lines
    assert_freed_within_steps(engine_stub, at_abort)
    assert_still_working(client)

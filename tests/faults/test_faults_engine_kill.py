"""The engine dies under load: every in-flight stream through the tokenizer service ends UNAVAILABLE promptly (a
hang fails the bounded wait, long before the calls' own deadline), and an engine restarted on the same port
serves new requests through the same tokenizer service process.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from llmserve.textgen.v1 import textgen_pb2_grpc
from tests.faults.stack import EXIT_TIMEOUT_S, ending, greedy_request
from tests.faults.streams import LENGTH, read_sync, streams_around

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_STREAMS = 8
LONG_MAX_TOKENS = 2000  # never reached: the engine dies first
CALL_TIMEOUT_S = 300.0  # far beyond ENDED_WITHIN_S: a stream still open then is a hang, not a deadline
ENDED_WITHIN_S = 30.0
PROMPT = "The engine is about to die:"


def generate_one(target: str) -> list[int]:
    with grpc.insecure_channel(target) as channel:
        outcome = read_sync(textgen_pb2_grpc.TextGenerationServiceStub(channel), greedy_request(PROMPT, 12), 60)
    assert not outcome.contract_violations(), outcome.contract_violations()
    assert (outcome.code, outcome.finish_reason, len(outcome.token_ids)) == (grpc.StatusCode.OK, LENGTH, 12), outcome
    return outcome.token_ids


def kill_core(stack) -> None:
    """SIGSTOP first, so no stream can finish in between; a stopped process still dies of SIGKILL."""
    core_pid = stack.engine_core_pid()
    os.kill(core_pid, signal.SIGSTOP)
    os.kill(core_pid, signal.SIGKILL)


def kill_service(stack) -> None:
    os.kill(stack.engine_core_pid(), signal.SIGSTOP)
    stack.kill_engine_service()


@pytest.mark.parametrize("victim", ["core", "service"])
def test_engine_killed_under_load_ends_streams_unavailable_and_a_restart_serves_again(faults_stack, victim):
    tokenizer_pid = faults_stack.tokenizer.proc.pid
    before = generate_one(faults_stack.tokenizer_target)
    kill = kill_core if victim == "core" else kill_service
    with ending(faults_stack.engine):
        requests = [greedy_request(f"{PROMPT} {i}", LONG_MAX_TOKENS) for i in range(NUM_STREAMS)]
        outcomes = asyncio.run(streams_around(faults_stack.tokenizer_target, requests, lambda: kill(faults_stack),
                                              CALL_TIMEOUT_S, ENDED_WITHIN_S))
        assert [outcome.code for outcome in outcomes] == [grpc.StatusCode.UNAVAILABLE] * NUM_STREAMS, \
            [(outcome.code.name, outcome.details) for outcome in outcomes]
        assert all(0 < len(outcome.token_ids) < LONG_MAX_TOKENS for outcome in outcomes)
        if victim == "core":  # the fronts see their core go and stop the service, non-zero
            assert faults_stack.engine.proc.wait(EXIT_TIMEOUT_S) != 0, faults_stack.engine.log_tail()
        with grpc.insecure_channel(faults_stack.tokenizer_target) as channel:
            down = read_sync(textgen_pb2_grpc.TextGenerationServiceStub(channel), greedy_request(PROMPT, 4), 60)
        assert down.code == grpc.StatusCode.UNAVAILABLE, down

    faults_stack.ensure_up()  # the engine again, on the same port
    assert faults_stack.tokenizer.proc.pid == tokenizer_pid and faults_stack.tokenizer.proc.poll() is None
    assert generate_one(faults_stack.tokenizer_target) == before

"""SIGTERM on either service with streams in flight: every stream still gets all its tokens, new requests are
refused with UNAVAILABLE, health says NOT_SERVING, and the service exits 0 within its grace period.

The engine core is paused (SIGSTOP) from just before the signal until the refusals have been checked, so the
streams are certainly in flight during the drain however fast the machine is.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2_grpc
from tests.faults.stack import ENGINE_FRONTS, GRACE_S, ending, NOT_SERVING, greedy_request
from tests.faults.streams import LENGTH, read_sync, streams_around
from tests.services.engine_pause import paused
from tests.services.procs import ENGINE_SERVICE, TEXTGEN_SERVICE, health_status, poll_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_STREAMS = 8
MAX_TOKENS = 200  # still running when the core is paused just before the signal
PROMPTS = ["Drain me gently, stream", "Finish what you started, stream"]
CALL_TIMEOUT_S = 300.0
DRAINING = "draining"  # services/common/grpc_server.py logs it in each process as its drain starts
DRAIN_START_TIMEOUT_S = 30.0


def requests():
    return [greedy_request(f"{PROMPTS[i % 2]} {i % 2}", MAX_TOKENS) for i in range(NUM_STREAMS)]


def alone(target: str) -> dict[str, list[int]]:
    with grpc.insecure_channel(target) as channel:
        stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
        return {request.text: read_sync(stub, request, CALL_TIMEOUT_S).token_ids for request in requests()[:2]}


def wait_draining(process, num_processes: int) -> None:
    """Until every process of the service has logged the start of its drain (an event, not a sleep)."""
    poll_until(lambda: True if sum(DRAINING in line for line in process.lines) >= num_processes else None,
               DRAIN_START_TIMEOUT_S, f"{num_processes} processes of {process.name} to start draining")


def assert_draining_health(target: str, service: str) -> None:
    """A draining server still answers health, NOT_SERVING (a readiness probe takes it out of rotation)."""
    assert health_status(target, service) == NOT_SERVING


def assert_refused(target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        late = read_sync(textgen_pb2_grpc.TextGenerationServiceStub(channel), greedy_request("Too late", 4), 30)
    assert late.code == grpc.StatusCode.UNAVAILABLE and not late.num_messages, late


def assert_engine_refuses(target: str) -> None:
    request = engine_pb2.GenerateRequest(request_id="too-late", prompt_token_ids=[10, 11, 12],
                                         sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4))
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(engine_pb2_grpc.EngineServiceStub(channel).Generate(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value


def assert_every_stream_complete(outcomes, reference: dict[str, list[int]]) -> None:
    for request, outcome in zip(requests(), outcomes):
        assert not outcome.contract_violations(), outcome.contract_violations()
        assert (outcome.code, outcome.finish_reason) == (grpc.StatusCode.OK, LENGTH), (outcome.code, outcome.details)
        assert outcome.token_ids == reference[request.text]


def test_sigterm_on_the_engine_finishes_streams_refuses_new_ones_and_exits_zero(faults_stack):
    reference = alone(faults_stack.tokenizer_target)
    engine = faults_stack.engine

    def drain() -> None:
        with paused(faults_stack.engine_core_pid()):
            engine.proc.send_signal(signal.SIGTERM)
            wait_draining(engine, ENGINE_FRONTS)
            assert_refused(faults_stack.tokenizer_target)
            assert_engine_refuses(faults_stack.engine_target)
            assert_draining_health(faults_stack.engine_target, ENGINE_SERVICE)

    with ending(engine):
        outcomes = asyncio.run(streams_around(faults_stack.tokenizer_target, requests(), drain, CALL_TIMEOUT_S,
                                              GRACE_S))
        assert_every_stream_complete(outcomes, reference)
        assert engine.proc.wait(GRACE_S) == 0, engine.log_tail()


def test_sigterm_on_the_tokenizer_service_finishes_streams_refuses_new_ones_and_exits_zero(faults_stack):
    reference = alone(faults_stack.tokenizer_target)
    tokenizer = faults_stack.tokenizer

    def drain() -> None:
        with paused(faults_stack.engine_core_pid()):
            tokenizer.proc.send_signal(signal.SIGTERM)
            wait_draining(tokenizer, 1)
            assert_draining_health(faults_stack.tokenizer_target, TEXTGEN_SERVICE)
            assert_refused(faults_stack.tokenizer_target)

    with ending(tokenizer):
        outcomes = asyncio.run(streams_around(faults_stack.tokenizer_target, requests(), drain, CALL_TIMEOUT_S,
                                              GRACE_S))
        assert_every_stream_complete(outcomes, reference)
        assert tokenizer.proc.wait(GRACE_S) == 0, tokenizer.log_tail()

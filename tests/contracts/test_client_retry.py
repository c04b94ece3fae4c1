"""The Python client's opt-in retries: refused calls (RESOURCE_EXHAUSTED, UNAVAILABLE before any message) are
sent again after RetryInfo's delay or a backoff; a stream that received a message never is.

A scripted fake server answers each Generate attempt as the test says; the client's waits are recorded, not slept.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from llmserve import AsyncLLMServeClient, LLMServeClient, LLMServeError, RetryPolicy, retry as retry_module
from llmserve.common.v1 import common_pb2
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc

FULL = ("full", 0.7)  # RESOURCE_EXHAUSTED with RetryInfo 0.7 s
FULL_NO_INFO = ("full", None)
DOWN = ("down", None)  # UNAVAILABLE before any message
OK = ("ok", None)
PARTIAL_THEN_DOWN = ("partial", None)  # one message, then UNAVAILABLE


class ScriptedTextGeneration(textgen_pb2_grpc.TextGenerationServiceServicer):
    """Generate answers attempt n with script[n]; counts attempts."""

    def __init__(self) -> None:
        self.script: list[tuple[str, float | None]] = []
        self.num_attempts = 0
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            action, delay = self.script[min(self.num_attempts, len(self.script) - 1)]
            self.num_attempts += 1
        if action == "full":
            status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="queue is full")
            if delay is not None:
                retry_delay = duration_pb2.Duration()
                retry_delay.FromNanoseconds(int(delay * 1e9))
                status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=retry_delay))
            context.abort_with_status(rpc_status.to_status(status))
        if action == "down":
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine is draining")
        yield textgen_pb2.GenerateResponse(request_id="r", text="hello ", token_ids=[5])
        if action == "partial":
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine went away")
        yield textgen_pb2.GenerateResponse(request_id="r", text="world", token_ids=[6],
                                           finish_reason=common_pb2.FINISH_REASON_STOP)

    def Tokenize(self, request, context):
        with self.lock:
            action, _ = self.script[min(self.num_attempts, len(self.script) - 1)]
            self.num_attempts += 1
        if action == "full":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        return textgen_pb2.TokenizeResponse(token_ids=[1, 2])


@pytest.fixture(scope="module")
def scripted():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = ScriptedTextGeneration()
    textgen_pb2_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The delays the client waited (recorded instead of slept), sync and asyncio."""
    recorded: list[float] = []

    async def async_sleep(seconds: float) -> None:
        recorded.append(seconds)

    monkeypatch.setattr(retry_module, "sleep", recorded.append)
    monkeypatch.setattr(retry_module, "async_sleep", async_sleep)
    return recorded


def run_script(scripted, script):
    target, servicer = scripted
    servicer.script = list(script)
    servicer.num_attempts = 0
    return target, servicer


NO_JITTER = RetryPolicy(max_retries=3, initial_backoff_s=0.1, multiplier=2.0, jitter=0.0)


def test_retries_a_full_queue_after_the_servers_retry_delay(scripted, waits):
    target, servicer = run_script(scripted, [FULL, FULL, OK])
    with LLMServeClient(target, retry=NO_JITTER) as client:
        result = client.complete("hi")
    assert result.text == "hello world" and servicer.num_attempts == 3
    assert waits == [pytest.approx(0.7), pytest.approx(0.7)]


def test_without_retry_info_the_backoff_grows_exponentially(scripted, waits):
    target, servicer = run_script(scripted, [FULL_NO_INFO, DOWN, FULL_NO_INFO, OK])
    with LLMServeClient(target, retry=NO_JITTER) as client:
        assert client.complete("hi").text == "hello world"
    assert waits == [pytest.approx(0.1), pytest.approx(0.2), pytest.approx(0.4)]


def test_gives_up_after_max_retries_with_the_last_error(scripted, waits):
    target, servicer = run_script(scripted, [FULL])
    with LLMServeClient(target, retry=2) as client:
        with pytest.raises(LLMServeError) as info:
            client.complete("hi")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_delay_s == pytest.approx(0.7)
    assert servicer.num_attempts == 3 and len(waits) == 2


def test_no_retry_unless_asked(scripted, waits):
    target, servicer = run_script(scripted, [FULL, OK])
    with LLMServeClient(target) as client:
        with pytest.raises(LLMServeError):
            client.complete("hi")
        assert servicer.num_attempts == 1
        servicer.num_attempts = 0
        assert client.complete("hi", retry=1).text == "hello world"  # asked for on one call
    assert servicer.num_attempts == 2 and len(waits) == 1 and 0.7 <= waits[0] <= 0.7 * 1.2  # default jitter 0.2


def test_never_retries_after_a_message_was_received(scripted, waits):
    target, servicer = run_script(scripted, [PARTIAL_THEN_DOWN, OK])
    with LLMServeClient(target, retry=3) as client:
        stream = client.generate("hi")
        with pytest.raises(LLMServeError) as info:
            list(stream)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.num_attempts == 1 and waits == []


def test_a_delay_past_the_timeout_is_not_waited_for(scripted, waits):
    target, servicer = run_script(scripted, [("full", 50.0), OK])
    with LLMServeClient(target, retry=3) as client:
        with pytest.raises(LLMServeError) as info:
            client.complete("hi", timeout=10)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and servicer.num_attempts == 1 and waits == []


def test_unary_calls_retry_too(scripted, waits):
    target, servicer = run_script(scripted, [FULL, OK])
    with LLMServeClient(target, retry=1) as client:
        assert client.tokenize("x").token_ids == [1, 2]
    assert servicer.num_attempts == 2 and len(waits) == 1


def test_jitter_only_lengthens_the_servers_delay():
    policy = RetryPolicy(jitter=0.5)
    error = LLMServeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_delay_s=2.0)
    delays = [policy.delay_s(0, error) for _ in range(50)]
    assert all(2.0 <= delay <= 3.0 for delay in delays)
    assert policy.delay_s(0, LLMServeError(grpc.StatusCode.INVALID_ARGUMENT, "bad")) is None


def test_async_client_retries_before_the_first_message_only(scripted, waits):
    async def scenario() -> None:
        target, servicer = run_script(scripted, [DOWN, FULL, OK])
        async with AsyncLLMServeClient(target, retry=NO_JITTER) as client:
            assert (await client.complete("hi")).text == "hello world"
            assert servicer.num_attempts == 3 and waits == [pytest.approx(0.1), pytest.approx(0.7)]
            run_script(scripted, [PARTIAL_THEN_DOWN, OK])
            with pytest.raises(LLMServeError) as info:
                await client.complete("hi")
            assert info.value.code == grpc.StatusCode.UNAVAILABLE and servicer.num_attempts == 1
            run_script(scripted, [FULL, OK])
            assert (await client.tokenize("x")).token_ids == [1, 2]

    asyncio.run(scenario())

"""Engine down: the tokenizer service answers UNAVAILABLE and reports NOT_SERVING, then recovers on restart.

Uses its own engine + tokenizer pair; the engine listens on a fixed free port so it can come back on it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from llmserve import FinishReason, LLMServeClient, LLMServeError
from tests.services.engine_pause import engine_core_pid
from tests.services.procs import (
    ENGINE_SERVICE,
    TEXTGEN_SERVICE,
    ServiceProcess,
    free_port,
    health_status,
    start_engine,
    start_tokenizer,
    wait_health,
)

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = "The capital of France is"
RECOVERY_TIMEOUT_S = 30.0


class Pair:
    """An engine on a fixed port and a tokenizer service in front of it; the engine can be killed and restarted."""

    def __init__(self) -> None:
        self.engine_port = free_port()
        self.engine_target = f"127.0.0.1:{self.engine_port}"
        self.engine: ServiceProcess = start_engine(self.engine_port)
        self.tokenizer: ServiceProcess = start_tokenizer(self.engine_target)

    def restart_engine(self) -> None:
        self.engine = start_engine(self.engine_port)
        assert self.engine.wait_port() == self.engine_port
        wait_health(self.engine_target, ENGINE_SERVICE, process=self.engine)

    def stop(self) -> None:
        for process in (self.tokenizer, self.engine):
            process.stop()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    pair = Pair()
    try:
        assert pair.engine.wait_port() == pair.engine_port
        wait_health(pair.engine_target, ENGINE_SERVICE, process=pair.engine)
        wait_health(pair.tokenizer.target, TEXTGEN_SERVICE, process=pair.tokenizer)
        yield pair
    finally:
        pair.stop()


def assert_unavailable(client: LLMServeClient) -> None:
    with pytest.raises(LLMServeError) as caught:
        client.complete(PROMPT, max_tokens=4, timeout=30)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE, caught.value


def assert_generates(client: LLMServeClient) -> None:
    result = client.complete(PROMPT, max_tokens=6, ignore_eos=True, temperature=0.0, timeout=60)
    assert result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == 6


def test_engine_killed_then_restarted(pair):
    with LLMServeClient(pair.tokenizer.target) as client:
        assert_generates(client)
        stream = client.generate(PROMPT, max_tokens=500, ignore_eos=True, temperature=0.0, timeout=120)
        deltas = iter(stream)
        next(deltas)

        core_pid = engine_core_pid(pair.engine.proc.pid)
        os.kill(core_pid, signal.SIGSTOP)  # the stream cannot finish before the engine dies, however fast it runs
        pair.engine.kill()
        os.kill(core_pid, signal.SIGKILL)  # paused, it would never see its parent go
        with pytest.raises(LLMServeError) as caught:  # the stream that was running when the engine died
            list(deltas)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE, caught.value
        assert_unavailable(client)
        wait_health(pair.tokenizer.target, TEXTGEN_SERVICE, NOT_SERVING, timeout_s=RECOVERY_TIMEOUT_S)
        assert health_status(pair.tokenizer.target, "") == SERVING  # alive, just not ready
        assert_unavailable(client)

        pair.restart_engine()
        wait_health(pair.tokenizer.target, TEXTGEN_SERVICE, SERVING, timeout_s=RECOVERY_TIMEOUT_S)
        assert_generates(client)

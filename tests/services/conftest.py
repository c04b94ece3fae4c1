"""Session fixtures: one real engine + tokenizer service pair (subprocesses, port 0) and one offline LLM."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from llmserve import LLMServeClient
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2_grpc
from tests.services.helpers import NUM_TORCH_THREADS, OfflineReference, torch_threads, wait_engine_idle
from tests.services.procs import (
    ENGINE_SERVICE,
    TEXTGEN_SERVICE,
    ServiceProcess,
    start_engine,
    start_tokenizer,
    wait_health,
)


@dataclass(slots=True)
class Stack:
    """A running engine + tokenizer pair."""

    engine: ServiceProcess
    tokenizer: ServiceProcess | None = None  # started once the engine's port is known

    @property
    def engine_target(self) -> str:
        return self.engine.target

    @property
    def tokenizer_target(self) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.target


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The shared pair, both reporting SERVING for their full service names."""
    stack = Stack(start_engine())
    try:
        stack.tokenizer = start_tokenizer(stack.engine_target)
        wait_health(stack.engine_target, ENGINE_SERVICE, process=stack.engine)
        wait_health(stack.tokenizer_target, TEXTGEN_SERVICE, process=stack.tokenizer)
        yield stack
    finally:
        for process in (stack.tokenizer, stack.engine):
            if process is not None:
                process.stop()


@pytest.fixture(scope="session")
def offline() -> OfflineReference:
    """The offline engine on the same model, for reference outputs."""
    from services.engine import LLM

    with torch_threads(NUM_TORCH_THREADS):
        return OfflineReference(LLM(max_model_len=1024, num_kvcache_blocks=256))


@pytest.fixture(scope="session")
def client(stack: Stack) -> Iterator[LLMServeClient]:
    with LLMServeClient(stack.tokenizer_target) as client:
        yield client


@pytest.fixture(scope="session")
def textgen_stub(stack: Stack) -> Iterator[textgen_pb2_grpc.TextGenerationServiceStub]:
    with grpc.insecure_channel(stack.tokenizer_target) as channel:
        yield textgen_pb2_grpc.TextGenerationServiceStub(channel)


@pytest.fixture(scope="session")
def engine_stub(stack: Stack) -> Iterator[engine_pb2_grpc.EngineServiceStub]:
    with grpc.insecure_channel(stack.engine_target) as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)


@pytest.fixture
def idle_engine(engine_stub) -> engine_pb2.LoadReport:
    """Start a test with an idle engine (and fail it if a previous test left work behind)."""
    return wait_engine_idle(engine_stub)

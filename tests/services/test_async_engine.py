"""AsyncEngine in-process: the real EngineCore on its thread with a fake runner whose steps the test releases.

Covers the waiting-queue limit (QueueFullError, and RESOURCE_EXHAUSTED with RetryInfo through the engine
servicer), validation before anything streams, abort on leaving the iteration early, and concurrent consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from grpc_status import rpc_status

from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from services.common.errors import InvalidRequestError, QueueFullError
from services.common.grpc_server import ServingState, build_server, status_for
from services.engine.serving.async_engine import AsyncEngine
from services.engine.core.config import SchedulerConfig
from services.engine.core.engine import EngineCore
from services.engine.core.interfaces import RequestOutput, SchedulerOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import FinishReason
from services.engine.serving.server import SERVICE_NAME, EngineServicer

BLOCK_SIZE = 4
VOCAB_SIZE = 10_000
EOS_ID = 2
STEP_TIMEOUT_S = 20.0
SCENARIO_TIMEOUT_S = 60.0


class GatedRunner:
    """Fake model runner: request r samples base(r) + i at sample index i; each step needs a permit until opened."""

    def __init__(self, bases: dict[str, int] | None = None):
        self.bases = bases or {}
        self.num_samples: Counter[str] = Counter()
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()

    def token(self, request_id: str, index: int) -> int:
        return self.bases.get(request_id, 500) + index

    def release(self, num_steps: int = 1) -> None:
        for _ in range(num_steps):
            self._permits.release()

    def open(self) -> None:
        """Let every step through from now on (and wake a step that waits for a permit)."""
        self._open.set()
        self._permits.release()

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        if not self._open.is_set() and not self._permits.acquire(timeout=STEP_TIMEOUT_S):
            raise TimeoutError("the test released no step")
        sampled: list[int | None] = []
        for seq in batch.seqs:
            if seq.num_cached_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                sampled.append(None)
                continue
            self.num_samples[seq.request_id] += 1
            sampled.append(self.token(seq.request_id, seq.num_completion_tokens))
        return sampled


def make_engine(runner: GatedRunner, max_waiting: int = 0, num_blocks: int = 8) -> AsyncEngine:
    """An AsyncEngine over the real EngineCore, with the queue limit in both places, as the service wires it."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=BLOCK_SIZE,
                             num_kvcache_blocks=num_blocks, max_waiting=max_waiting)
    return AsyncEngine(EngineCore(config, runner, (EOS_ID,), VOCAB_SIZE), max_waiting=max_waiting)


def prompt(num_tokens: int, start: int = 10) -> list[int]:
    return list(range(start, start + num_tokens))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def collect(stream: AsyncIterator[RequestOutput], into: list[RequestOutput]) -> list[RequestOutput]:
    async for output in stream:
        into.append(output)
    return into


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.005) + 2):
        if predicate():
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario, SCENARIO_TIMEOUT_S))


@contextlib.asynccontextmanager
async def started(engine: AsyncEngine, runner: GatedRunner):
    engine.start()
    try:
        yield engine
    finally:
        runner.open()
        await asyncio.to_thread(engine.shutdown)


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [token_id for output in outputs for token_id in output.new_token_ids]


def assert_finished_by_length(runner: GatedRunner, request_id: str, outputs: list[RequestOutput], n: int) -> None:
    assert tokens(outputs) == [runner.token(request_id, i) for i in range(n)]
    assert [output.finish_reason for output in outputs] == [None] * (len(outputs) - 1) + [FinishReason.LENGTH]
    assert outputs[-1].num_completion_tokens == n


def is_idle(engine: AsyncEngine) -> bool:
    stats = engine.stats()
    return (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)


def assert_resource_exhausted_with_retry_info(status) -> None:
    assert status.code == code_pb2.RESOURCE_EXHAUSTED
    [detail] = status.details
    assert detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR)
    retry = error_details_pb2.RetryInfo()
    detail.Unpack(retry)
    assert retry.retry_delay.ToTimedelta().total_seconds() > 0


def test_second_request_is_refused_while_the_first_is_queued():
    async def scenario() -> None:
        runner = GatedRunner()
        engine = make_engine(runner, max_waiting=1)
        first = engine.generate("a", prompt(4), greedy(3))
        first_task = asyncio.create_task(collect(first, []))
        await until(lambda: engine.is_live("a"), "the first request to be queued")
        with pytest.raises(QueueFullError) as caught:
            await anext(engine.generate("b", prompt(4, 100), greedy(3)))
        assert not engine.is_live("b")
        status = status_for(caught.value)
        assert_resource_exhausted_with_retry_info(status)
        assert "waiting queue is full" in status.message
        async with started(engine, runner):
            runner.open()
            assert_finished_by_length(runner, "a", await first_task, 3)
        assert runner.num_samples["b"] == 0

    run(scenario())


def test_queue_limit_counts_sequences_waiting_for_kv_blocks():
    async def scenario() -> None:
        runner = GatedRunner({"a": 1000, "b": 2000})
        engine = make_engine(runner, max_waiting=1, num_blocks=8)
        async with started(engine, runner):
            a_outputs: list[RequestOutput] = []
            # 21 prompt tokens take 6 of the 8 blocks; with 12 tokens to generate "a" grows into all 8.
            a_task = asyncio.create_task(collect(engine.generate("a", prompt(21), greedy(12)), a_outputs))
            runner.release(2)
            await until(lambda: len(a_outputs) == 2, "two tokens of a")
            b_outputs: list[RequestOutput] = []
            b_task = asyncio.create_task(collect(engine.generate("b", prompt(12, 300), greedy(2)), b_outputs))
            await until(lambda: engine.is_live("b"), "b to be accepted")
            runner.release(2)  # two steps refresh the engine's figures with b waiting for blocks
            await until(lambda: len(a_outputs) == 4 and engine.stats().num_waiting == 1, "b to wait for blocks")
            assert b_outputs == [] and engine.stats().num_running == 1
            with pytest.raises(QueueFullError):
                await anext(engine.generate("c", prompt(4, 600), greedy(2)))
            assert not engine.is_live("c")
            runner.open()
            assert_finished_by_length(runner, "a", await a_task, 12)
            assert_finished_by_length(runner, "b", await b_task, 2)
            await until(lambda: is_idle(engine), "every block to be free")
        assert runner.num_samples["c"] == 0

    run(scenario())


def test_validation_error_comes_before_anything_streams():
    async def scenario() -> None:
        runner = GatedRunner()
        engine = make_engine(runner)
        async with started(engine, runner):
            cases = [(prompt(3, VOCAB_SIZE - 1), greedy(2), "prompt.token_ids"), ([], greedy(2), "prompt"),
                     (prompt(60), greedy(5), "max_tokens")]
            for prompt_ids, sampling, field in cases:
                stream = engine.generate("bad", prompt_ids, sampling)
                with pytest.raises(InvalidRequestError) as caught:
                    await anext(stream)
                assert caught.value.field == field
                assert not engine.is_live("bad") and not engine.core.has_unfinished_requests()
            assert runner.num_samples == Counter()

    run(scenario())


def test_leaving_the_iteration_early_aborts_and_frees_blocks():
    async def scenario() -> None:
        runner = GatedRunner()
        engine = make_engine(runner, num_blocks=16)
        async with started(engine, runner):
            runner.release(1)
            stream = engine.generate("a", prompt(4), greedy(40))
            async with contextlib.aclosing(stream):
                async for output in stream:
                    assert output.new_token_ids == [runner.token("a", 0)]
                    break
            assert not engine.is_live("a")
            runner.open()
            await until(lambda: not engine.core.has_unfinished_requests() and is_idle(engine),
                        "the aborted request's blocks to be free")
        assert runner.num_samples["a"] <= 2, "the request ran on instead of being aborted"

    run(scenario())


def test_outputs_reach_their_own_concurrent_consumers():
    async def scenario() -> None:
        request_ids = [f"r{i}" for i in range(6)]
        runner = GatedRunner({request_id: 1000 * (i + 1) for i, request_id in enumerate(request_ids)})
        engine = make_engine(runner, num_blocks=32)
        runner.open()
        async with started(engine, runner):
            streams = [collect(engine.generate(request_id, prompt(3 + i, 50 * i), greedy(2 + i)), [])
                       for i, request_id in enumerate(request_ids)]
            results = await asyncio.gather(*streams)
        for i, (request_id, outputs) in enumerate(zip(request_ids, results)):
            assert_finished_by_length(runner, request_id, outputs, 2 + i)
            assert {output.request_id for output in outputs} == {request_id}

    run(scenario())


def test_engine_servicer_answers_resource_exhausted_with_retry_info():
    async def scenario() -> None:
        runner = GatedRunner()
        engine = make_engine(runner, max_waiting=1)
        info = engine_pb2.GetEngineInfoResponse(vocab_size=VOCAB_SIZE, max_model_len=64, eos_token_ids=[EOS_ID])
        state = ServingState(SERVICE_NAME)
        servicer = EngineServicer(engine, info, state)
        server = build_server([SERVICE_NAME], state, servicer.register)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = engine_pb2_grpc.EngineServiceStub(channel)
                first = stub.Generate(engine_pb2.GenerateRequest(request_id="a", prompt_token_ids=prompt(4),
                                                                 sampling={"temperature": 0, "max_tokens": 3}))
                await until(lambda: engine.is_live("a"), "the first request to be queued")
                second = stub.Generate(engine_pb2.GenerateRequest(request_id="b", prompt_token_ids=prompt(4),
                                                                  sampling={"temperature": 0, "max_tokens": 3}))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await second.read()
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert_resource_exhausted_with_retry_info(rpc_status.from_call(caught.value))
                async with started(engine, runner):
                    runner.open()
                    responses = [response async for response in first]
                assert [token for r in responses for token in r.token_ids] == [runner.token("a", i) for i in range(3)]
        finally:
            await server.stop(None)

    run(scenario())

"""The streaming engine loop: CoreLoop (on a thread here, its own process in the service) and AsyncEngine fronts.

The real EngineCore steps with a fake runner whose steps the test releases, behind real connections
(multiprocessing pipes), as the service wires them. Covers the waiting-queue limit (QueueFullError, and
RESOURCE_EXHAUSTED with RetryInfo through the engine servicer), validation before anything streams,
abort on leaving the iteration early (KV freed within a step), coalescing of tokens a slow reader has not
taken, a core that never waits for a reader, several fronts on one core, and a dead core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from grpc_status import rpc_status

from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from services.common.errors import DuplicateRequestError, InvalidRequestError, QueueFullError, UnavailableError
from services.common.grpc_server import ServingState, build_server, status_for
from services.engine.core.config import SchedulerConfig
from services.engine.core.engine import EngineCore
from services.engine.core.interfaces import RequestOutput, SchedulerOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import FinishReason
from services.common.metrics import RequestObserver
from services.engine.serving.async_engine import AsyncEngine
from services.engine.serving.batch_session import BatchSession
from services.engine.serving.engine_process import CoreLoop, EngineDescription
from services.engine.core.request_validator import RequestValidator
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
        self.num_steps = 0
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
        self.num_steps += 1
        sampled: list[int | None] = []
        for seq in batch.seqs:
            if seq.num_cached_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                sampled.append(None)
                continue
            self.num_samples[seq.request_id] += 1
            sampled.append(self.token(seq.request_id, seq.num_completion_tokens))
        return sampled


class Harness:
    """A CoreLoop on a thread over the real EngineCore, with `num_fronts` AsyncEngine fronts connected to it."""

    def __init__(self, runner: GatedRunner, max_waiting: int = 0, num_blocks: int = 8, num_fronts: int = 1,
                 max_num_batched_tokens: int = 64, stream_interval: int = 1):
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, max_model_len=64, block_size=BLOCK_SIZE,
                                 num_kvcache_blocks=num_blocks, max_waiting=max_waiting)
        self.runner = runner
        self.core = EngineCore(config, runner, (EOS_ID,), VOCAB_SIZE)
        self.description = EngineDescription({}, config, [EOS_ID], VOCAB_SIZE, num_blocks)
        pairs = [mp.Pipe(duplex=True) for _ in range(num_fronts)]
        self.core_ends = [core_end for _, core_end in pairs]
        self.loop = CoreLoop(self.core, self.core_ends, self.description)
        self.thread = threading.Thread(target=self.loop.run, name="core-loop", daemon=True)
        self.thread.start()
        self.lost: list[int] = []
        self.fronts = [AsyncEngine.connect(front_end, on_core_lost=lambda i=i: self.lost.append(i), timeout_s=10,
                                           stream_interval=stream_interval)
                       for i, (front_end, _) in enumerate(pairs)]

    @property
    def engine(self) -> AsyncEngine:
        return self.fronts[0]

    def start(self) -> None:
        for front in self.fronts:
            front.start()

    async def close(self) -> None:
        self.runner.open()
        for front in self.fronts:
            front.shutdown()
        await asyncio.to_thread(self.thread.join, 10)
        assert not self.thread.is_alive(), "the core loop did not end when every front hung up"


@contextlib.asynccontextmanager
async def harness(runner: GatedRunner, **kwargs):
    h = Harness(runner, **kwargs)
    h.start()
    try:
        yield h
    finally:
        await h.close()


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


async def refused_behind_a_chunked_prefill(h: Harness, second):
    """Queue "a" (a 20-token prompt, prefilled 8 tokens a step), then try `second` while "a" still waits."""
    first_task = asyncio.create_task(collect(h.engine.generate("a", prompt(20), greedy(3)), []))
    await until(lambda: h.core.has_unfinished_requests(), "the first request to be queued")
    second_task = asyncio.ensure_future(second())
    await until(lambda: h.core_ends[0].poll(), "the second request to reach the core's connection")
    h.runner.release(1)  # the core reads the second request once this first prefill chunk is done
    with pytest.raises(Exception) as caught:
        await second_task
    return first_task, caught.value


def test_second_request_is_refused_while_the_first_is_queued():
    async def scenario() -> None:
        runner = GatedRunner()
        async with harness(runner, max_waiting=1, max_num_batched_tokens=8) as h:
            first_task, error = await refused_behind_a_chunked_prefill(
                h, lambda: anext(h.engine.generate("b", prompt(4, 100), greedy(3))))
            assert isinstance(error, QueueFullError)
            assert not h.engine.is_live("b")
            status = status_for(error)
            assert_resource_exhausted_with_retry_info(status)
            assert "waiting queue is full" in status.message
            runner.open()
            assert_finished_by_length(runner, "a", await first_task, 3)
        assert runner.num_samples["b"] == 0

    run(scenario())


def test_validation_error_comes_before_anything_streams():
    async def scenario() -> None:
        runner = GatedRunner()
        async with harness(runner) as h:
            validator = RequestValidator.for_config(h.description.scheduler_config, VOCAB_SIZE)
            cases = [(prompt(3, VOCAB_SIZE - 1), greedy(2), "prompt_token_ids"), ([], greedy(2), "prompt_token_ids"),
                     (prompt(60), greedy(5), "sampling.max_tokens")]
            for prompt_ids, sampling, field in cases:
                with pytest.raises(InvalidRequestError) as caught:
                    validator.validate(prompt_ids, sampling)
                assert caught.value.field == field
            assert runner.num_samples == Counter() and not h.core.has_unfinished_requests()

    run(scenario())


def test_leaving_the_iteration_early_aborts_and_frees_blocks_within_a_step():
    async def scenario() -> None:
        runner = GatedRunner()
        async with harness(runner, num_blocks=16) as h:
            runner.release(1)
            stream = h.engine.generate("a", prompt(4), greedy(40))
            async with contextlib.aclosing(stream):
                async for output in stream:
                    assert output.new_token_ids == [runner.token("a", 0)]
                    break
            assert not h.engine.is_live("a")
            assert h.engine.num_finished_requests == 1, "a cancelled call is finished once its stream closes"
            await until(lambda: h.core_ends[0].poll() or h.core.stats().num_used_blocks == 0,
                        "the abort to reach the core")
            steps_at_cancel = runner.num_steps
            runner.open()
            await until(lambda: not h.core.has_unfinished_requests() and is_idle(h.engine),
                        "the aborted request's blocks to be free")
            assert runner.num_steps - steps_at_cancel <= 1, "the request ran on instead of being aborted"
            assert h.engine.num_finished_requests == 1

    run(scenario())


def test_a_slow_reader_gets_every_pending_token_in_one_output():
    async def scenario() -> None:
        runner = GatedRunner()
        async with harness(runner, num_blocks=16) as h:
            stream = h.engine.generate("a", prompt(4), greedy(6))
            runner.release(1)
            first = await anext(stream)
            assert first.new_token_ids == [runner.token("a", 0)]
            runner.release(3)
            await until(lambda: h.engine.stats().num_generated_tokens == 4, "three more steps")
            second = await anext(stream)
            assert second.new_token_ids == [runner.token("a", i) for i in (1, 2, 3)]
            assert second.num_completion_tokens == 4 and second.finish_reason is None
            runner.release(2)
            last = await anext(stream)
            while last.finish_reason is None:
                last = await anext(stream)
            assert last.finish_reason == FinishReason.LENGTH and last.num_completion_tokens == 6

    run(scenario())


def test_a_stream_interval_sends_the_first_token_alone_then_every_n_tokens_and_the_finish_at_once():
    async def scenario() -> None:
        runner = GatedRunner()
        async with harness(runner, num_blocks=16, stream_interval=3) as h:
            stream = h.engine.generate("a", prompt(4), greedy(6))
            runner.release(1)
            first = await anext(stream)
            assert first.new_token_ids == [runner.token("a", 0)]
            runner.release(2)
            await until(lambda: h.engine.stats().num_generated_tokens == 3, "two more steps")
            waiting = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.05)  # two pending tokens are fewer than the interval: nothing to read yet
            assert not waiting.done()
            runner.release(1)
            assert (await waiting).new_token_ids == [runner.token("a", i) for i in (1, 2, 3)]
            runner.release(2)
            last = await anext(stream)
            assert last.new_token_ids == [runner.token("a", 4), runner.token("a", 5)]
            assert last.finish_reason == FinishReason.LENGTH

    run(scenario())


def test_a_batch_session_collects_by_the_stream_interval_too():
    """A GenerateBatch call's session (one StreamSink for many requests) gets a request's outputs in the same
    chunks as a Generate reader: the first token alone, then every 3, the finish at once; a collect() between
    them finds nothing."""
    async def scenario() -> None:
        runner = GatedRunner()
        async with harness(runner, num_blocks=16, stream_interval=3) as h:
            session = BatchSession(h.engine, RequestObserver(logging.getLogger(__name__)), lambda exc: "ERROR")
            session.admit(session.start("a"), prompt(4), greedy(6))

            async def chunk() -> list[int]:
                await asyncio.wait_for(session.wakeup.wait(), STEP_TIMEOUT_S)
                outputs = session.collect().outputs
                assert len(outputs) == 1
                return outputs[0][1].new_token_ids

            runner.release(1)
            assert await chunk() == [runner.token("a", 0)]
            runner.release(2)
            await until(lambda: h.engine.stats().num_generated_tokens == 3, "two more steps")
            assert session.collect().outputs == []  # two pending tokens are fewer than the interval
            runner.release(1)
            assert await chunk() == [runner.token("a", i) for i in (1, 2, 3)]
            runner.release(2)
            assert await chunk() == [runner.token("a", 4), runner.token("a", 5)]
            assert not session.requests  # the finish ended the request

    run(scenario())


def test_the_core_steps_on_without_waiting_for_any_reader():
    async def scenario() -> None:
        runner = GatedRunner()
        async with harness(runner, num_blocks=32) as h:
            streams = [h.engine.generate(f"r{i}", prompt(4, 100 * i), greedy(5)) for i in range(3)]
            first_items = [asyncio.ensure_future(anext(stream)) for stream in streams]
            runner.open()
            await until(lambda: h.engine.num_finished_requests == 3, "every request to finish in the core")
            for request_index, (stream, first) in enumerate(zip(streams, first_items)):
                outputs = [await first] + [output async for output in stream]
                assert_finished_by_length(runner, f"r{request_index}", outputs, 5)
                assert len(outputs) <= 2, "the reader fell behind, so its tokens should have come coalesced"

    run(scenario())


def test_outputs_reach_their_own_concurrent_consumers():
    async def scenario() -> None:
        request_ids = [f"r{i}" for i in range(6)]
        runner = GatedRunner({request_id: 1000 * (i + 1) for i, request_id in enumerate(request_ids)})
        runner.open()
        async with harness(runner, num_blocks=32) as h:
            streams = [collect(h.engine.generate(request_id, prompt(3 + i, 50 * i), greedy(2 + i)), [])
                       for i, request_id in enumerate(request_ids)]
            results = await asyncio.gather(*streams)
        for i, (request_id, outputs) in enumerate(zip(request_ids, results)):
            assert_finished_by_length(runner, request_id, outputs, 2 + i)
            assert {output.request_id for output in outputs} == {request_id}

    run(scenario())


async def between_steps(h: Harness, awaitable, max_steps: int = 20):
    """Await something the core answers between steps, releasing one step at a time until it is answered."""
    task = asyncio.ensure_future(awaitable)
    for _ in range(max_steps):
        done, _ = await asyncio.wait({task}, timeout=0.05)
        if done:
            return task.result()
        h.runner.release(1)
    return await asyncio.wait_for(task, STEP_TIMEOUT_S)


def test_two_fronts_share_one_core_and_abort_each_others_requests():
    async def scenario() -> None:
        runner = GatedRunner({"a": 1000, "b": 2000})
        async with harness(runner, num_blocks=32, num_fronts=2) as h:
            front_a, front_b = h.fronts
            a_stream = front_a.generate("a", prompt(4), greedy(30))
            b_task = asyncio.create_task(collect(front_b.generate("b", prompt(4, 300), greedy(3)), []))
            first_a = await between_steps(h, anext(a_stream))
            assert first_a.new_token_ids == [runner.token("a", 0)]
            with pytest.raises(DuplicateRequestError):
                await between_steps(h, anext(front_b.generate("a", prompt(4, 600), greedy(2))))
            assert await between_steps(h, front_b.abort_any(["a", "nobody"])) == (["a"], [])
            runner.open()
            rest = [output async for output in a_stream]
            assert rest[-1].finish_reason == FinishReason.ABORTED
            assert_finished_by_length(runner, "b", await b_task, 3)
            await until(lambda: is_idle(front_a) and is_idle(front_b), "both fronts to see every block free")

    run(scenario())


def test_a_front_that_hangs_up_has_its_requests_aborted():
    async def scenario() -> None:
        runner = GatedRunner()
        async with harness(runner, num_blocks=32, num_fronts=2) as h:
            leaving, staying = h.fronts
            runner.release(1)
            stream = leaving.generate("a", prompt(4), greedy(30))
            await anext(stream)
            leaving.shutdown()
            runner.open()
            await until(lambda: not h.core.has_unfinished_requests(), "the core to drop the request")
            assert h.core.stats().num_used_blocks == 0
            assert runner.num_samples["a"] <= 2, "the request ran on after its front hung up"
            outputs = await collect(staying.generate("b", prompt(4, 300), greedy(2)), [])
            assert_finished_by_length(runner, "b", outputs, 2)
            await stream.aclose()

    run(scenario())


def test_a_dead_core_fails_every_stream_unavailable_and_says_so():
    async def scenario() -> None:
        runner = GatedRunner()
        h = Harness(runner, num_blocks=32)
        h.start()
        runner.release(1)
        stream = h.engine.generate("a", prompt(4), greedy(30))
        await anext(stream)
        waiting = asyncio.ensure_future(anext(stream))
        h.loop._open.clear()  # the loop thread leaves at its next look; closing its end is what a death looks like
        for core_end in h.core_ends:
            core_end.close()
        with pytest.raises(UnavailableError):
            await waiting
        assert h.lost == [0] and h.engine.core_lost
        with pytest.raises(UnavailableError):
            await anext(h.engine.generate("b", prompt(4), greedy(2)))
        runner.open()
        await asyncio.to_thread(h.thread.join, 10)
        h.engine.shutdown()

    run(scenario())


def test_engine_servicer_answers_resource_exhausted_with_retry_info():
    async def scenario() -> None:
        runner = GatedRunner()
        async with harness(runner, max_waiting=1, max_num_batched_tokens=8) as h:
            info = engine_pb2.GetEngineInfoResponse(vocab_size=VOCAB_SIZE, max_model_len=64, eos_token_ids=[EOS_ID])
            state = ServingState(SERVICE_NAME)
            servicer = EngineServicer(h.engine, info, state, RequestValidator.for_config(h.description.scheduler_config, VOCAB_SIZE))
            server = build_server([SERVICE_NAME], state, servicer.register)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = engine_pb2_grpc.EngineServiceStub(channel)
                    first = stub.Generate(engine_pb2.GenerateRequest(request_id="a", prompt_token_ids=prompt(20),
                                                                     sampling={"temperature": 0, "max_tokens": 3}))
                    await until(lambda: h.core.has_unfinished_requests(), "the first request to be queued")
                    second = stub.Generate(engine_pb2.GenerateRequest(request_id="b", prompt_token_ids=prompt(4),
                                                                      sampling={"temperature": 0, "max_tokens": 3}))
                    second_read = asyncio.ensure_future(second.read())
                    await until(lambda: h.core_ends[0].poll(), "the second request to reach the core's connection")
                    runner.release(1)
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await second_read
                    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert_resource_exhausted_with_retry_info(rpc_status.from_call(caught.value))
                    runner.open()
                    responses = [response async for response in first]
                    assert [t for r in responses for t in r.token_ids] == [runner.token("a", i) for i in range(3)]
                    load = await stub.GetLoad(engine_pb2.GetLoadRequest())
                    assert load.num_finished_requests == 1 and load.num_generated_tokens == 3
            finally:
                await server.stop(None)

    run(scenario())

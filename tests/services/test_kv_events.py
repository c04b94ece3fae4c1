"""KV-cache events through the streaming engine loop: CoreLoop on a thread, AsyncEngine fronts, the servicer.

A subscriber replays its snapshot and changes into a set; after a workload with shared prefixes, evictions
and recomputed duplicates, that set must equal the core's cached hashes, on either front, for an early and
a late subscriber alike. Also: no recording without subscribers, a lagging reader ended RESOURCE_EXHAUSTED,
a dead core or a drain ending subscriptions UNAVAILABLE, and the protobuf stream (block_size, load).
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import grpc
import pytest

from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from services.common.block_hash import prompt_block_hashes
from services.common.errors import UnavailableError
from services.common.grpc_server import ServingState, build_server
from services.engine.core.request_validator import RequestValidator
from services.engine.serving.async_engine import AsyncEngine
from services.engine.serving.kv_subscribers import SubscriberLagError
from services.engine.serving.server import SERVICE_NAME, EngineServicer
from tests.services.test_async_engine import (
    BLOCK_SIZE, EOS_ID, VOCAB_SIZE, GatedRunner, Harness, collect, greedy, harness, prompt, run, until)


class Replay:
    """A router's view of one engine's cache: the snapshot, then every change, applied to a set."""

    def __init__(self, engine: AsyncEngine):
        self.stream = engine.kv_events()
        self.hashes: set[int] = set()
        self.num_snapshots = 0
        self.num_removed = 0
        self.error: BaseException | None = None
        self.task = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        try:
            async for batch in self.stream:
                assert not set(batch.stored_block_hashes) & set(batch.removed_block_hashes)
                if batch.snapshot:
                    self.num_snapshots += 1
                    self.hashes = set(batch.stored_block_hashes)
                    assert not batch.removed_block_hashes
                else:
                    assert self.num_snapshots == 1, "changes came before the snapshot"
                    self.num_removed += len(batch.removed_block_hashes)
                    self.hashes -= set(batch.removed_block_hashes)
                    self.hashes |= set(batch.stored_block_hashes)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            self.error = exc

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.stream.aclose()


def cached_hashes(h: Harness) -> set[int]:
    return set(h.core.scheduler.block_manager.hash_to_block_id)


def is_recording(h: Harness) -> bool:
    return h.core.scheduler.block_manager._events is not None


async def workload(h: Harness, rng: random.Random, name: str, num_requests: int) -> None:
    """Requests over a few shared prefixes (hits, evictions in a small cache), some sent twice at once
    (recomputed duplicates), spread over every front."""
    prefixes = [prompt(8, 100), prompt(12, 300), prompt(5, 700)]
    requests = []
    for i in range(num_requests):
        tokens = rng.choice(prefixes) + prompt(rng.randrange(0, 6), 1000 + 10 * i)
        requests.append((f"{name}{i}", tokens))
        if rng.random() < 0.3:
            requests.append((f"{name}{i}-twin", list(tokens)))
    outputs = await asyncio.gather(*[
        collect(h.fronts[i % len(h.fronts)].generate(request_id, tokens, greedy(rng.randrange(1, 9))), [])
        for i, (request_id, tokens) in enumerate(requests)])
    assert all(result[-1].finished for result in outputs)


def test_replayed_subscribers_equal_the_cores_cached_hashes_early_and_late_on_both_fronts():
    async def scenario() -> None:
        runner = GatedRunner()
        runner.open()
        rng = random.Random(7)
        async with harness(runner, num_blocks=24, num_fronts=2) as h:
            await workload(h, rng, "before", 6)
            assert not is_recording(h), "events were recorded with nobody subscribed"
            early = Replay(h.fronts[0])
            await until(lambda: early.num_snapshots == 1, "the early subscriber's snapshot")
            assert early.hashes == cached_hashes(h) != set()
            await workload(h, rng, "a", 12)
            late = Replay(h.fronts[1])
            await until(lambda: late.num_snapshots == 1, "the late subscriber's snapshot")
            await workload(h, rng, "b", 12)
            await until(lambda: early.hashes == late.hashes == cached_hashes(h),
                        "both replays to catch up with the cache")
            assert early.error is None and late.error is None
            assert early.num_removed > 0 and late.num_removed > 0, "the workload evicted nothing"
            await early.close()
            assert is_recording(h), "the other front still has a subscriber"
            await late.close()
            await until(lambda: not is_recording(h), "recording to stop once nobody subscribes")

    run(scenario())


def test_a_reader_that_falls_too_far_behind_is_ended_resource_exhausted():
    async def scenario() -> None:
        runner = GatedRunner()
        runner.open()
        async with harness(runner, num_blocks=32) as h:
            h.engine._kv_subscribers.max_pending = 3
            stream = h.engine.kv_events()
            first = await anext(stream)
            assert first.snapshot and first.stored_block_hashes == []
            outputs = await collect(h.engine.generate("a", prompt(20), greedy(2)), [])  # stores 5 blocks unread
            assert outputs[-1].finished
            with pytest.raises(SubscriberLagError):
                await anext(stream)
            await until(lambda: not is_recording(h), "the lagging subscriber to be unsubscribed")

    run(scenario())


def test_a_dead_core_ends_subscriptions_unavailable():
    async def scenario() -> None:
        runner = GatedRunner()
        h = Harness(runner, num_blocks=32)
        h.start()
        stream = h.engine.kv_events()
        assert (await anext(stream)).snapshot
        waiting = asyncio.ensure_future(anext(stream))
        h.loop._open.clear()
        for core_end in h.core_ends:
            core_end.close()
        with pytest.raises(UnavailableError):
            await waiting
        with pytest.raises(UnavailableError):
            await anext(h.engine.kv_events())
        runner.open()
        await asyncio.to_thread(h.thread.join, 10)
        h.engine.shutdown()

    run(scenario())


def test_the_servicer_streams_hashes_block_size_and_load_and_ends_unavailable_on_drain():
    async def scenario() -> None:
        runner = GatedRunner()
        runner.open()
        async with harness(runner, num_blocks=32) as h:
            info = engine_pb2.GetEngineInfoResponse(vocab_size=VOCAB_SIZE, max_model_len=64, eos_token_ids=[EOS_ID],
                                                    block_size=BLOCK_SIZE)
            state = ServingState(SERVICE_NAME)
            validator = RequestValidator.for_config(h.description.scheduler_config, VOCAB_SIZE)
            server = build_server([SERVICE_NAME], state, EngineServicer(h.engine, info, state, validator).register)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = engine_pb2_grpc.EngineServiceStub(channel)
                    call = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest())
                    first = await call.read()
                    assert first.snapshot and first.block_size == BLOCK_SIZE and not first.stored_block_hashes
                    assert first.load.num_total_blocks == 32
                    tokens = prompt(10)
                    await collect(h.engine.generate("a", tokens, greedy(1)), [])
                    stored: list[int] = []
                    while len(stored) < 2:
                        message = await call.read()
                        assert not message.snapshot and message.block_size == BLOCK_SIZE
                        stored += message.stored_block_hashes
                    assert stored == prompt_block_hashes(tokens, BLOCK_SIZE)
                    await state.mark_draining()
                    with pytest.raises(grpc.aio.AioRpcError) as ended:
                        while True:
                            await call.read()
                    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest()).read()
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                await server.stop(None)

    run(scenario())

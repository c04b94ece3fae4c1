"""The tokenizer service over several engine replicas (services/tokenizer/serving/engine_pool.py), against in-process
fake engines (tests/tokenizer/fake_engine.py): failover, rejoin, RESOURCE_EXHAUSTED retries, DNS changes and
prefix routing fed by KV events. Every wait is on a condition, bounded only so that a bug fails instead of hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llmserve.common.v1 import common_pb2
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from services.common.block_hash import prompt_block_hashes
from services.common.grpc_server import ServingState, build_server
from services.tokenizer.serving.engine_client import EngineClient
from services.tokenizer.serving import engine_pool
from services.tokenizer.serving.engine_pool import EnginePool
from services.tokenizer.routing import Routing
from services.tokenizer.routing_targets import EngineTarget, parse_targets
from services.tokenizer.serving.server import SERVICE_NAME, TextGenerationServicer, health_follower
from services.tokenizer.tokenizer import TextTokenizer
from tests.services.procs import free_port
from tests.tokenizer.fake_engine import BLOCK_SIZE, FakeEngine
from tests.tokenizer.helpers import build_tiny_tokenizer_dir

WATCH_S = 0.02
HANG_S = 20.0  # a bound for waits that only a bug makes long
PROMPT = [3, 4, 5, 6, 7, 8, 9, 10]  # two full blocks


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> TextTokenizer:
    words = [f"w{i}" for i in range(30)]
    return TextTokenizer.load(build_tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"), words))


async def until(predicate, what: str) -> None:
    for _ in range(int(HANG_S / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never became true: {what}")


@contextlib.asynccontextmanager
async def served(tokenizer: TextTokenizer, targets: list[EngineTarget], routing: Routing, **pool_kwargs):
    """(pool, readiness flips, public stub) of a tokenizer servicer over `targets` on 127.0.0.1:0."""
    state = ServingState(SERVICE_NAME)
    flips: list[bool] = []
    follow = health_follower(state)

    async def on_ready(ready: bool) -> None:
        flips.append(ready)
        await follow(ready)

    pool_kwargs.setdefault("watch_interval_s", WATCH_S)
    pool = EnginePool(targets, tokenizer.fingerprint(), routing, on_ready, **pool_kwargs)
    servicer = TextGenerationServicer(tokenizer, pool, state)
    server = build_server([SERVICE_NAME], state, servicer.register)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await pool.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pool, flips, textgen_pb2_grpc.TextGenerationServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(None)
        await pool.close()


def request(prompt_ids=PROMPT) -> textgen_pb2.GenerateRequest:
    return textgen_pb2.GenerateRequest(token_ids={"ids": prompt_ids})


async def complete(stub, prompt_ids=PROMPT) -> int:
    finish = None
    async for response in stub.Generate(request(prompt_ids), timeout=HANG_S):
        finish = response.finish_reason
    return finish


class ClosingClient(EngineClient):
    closed = False

    async def close(self) -> None:
        self.closed = True
        await super().close()


def num_ready(pool: EnginePool) -> int:
    return sum(member.replica.ready for member in pool.members.values())


async def started(*engines: FakeEngine) -> list[EngineTarget]:
    return parse_targets([",".join([await engine.start() for engine in engines])])


def test_a_dead_replicas_stream_ends_unavailable_others_take_over_and_it_rejoins(tiny_tokenizer):
    async def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        targets = await started(a, b)
        async with served(tiny_tokenizer, targets, Routing.ROUND_ROBIN) as (pool, flips, stub):
            await until(lambda: num_ready(pool) == 2, "both replicas ready")
            a.gate.clear()
            b.gate.clear()
            held = stub.Generate(request(), timeout=HANG_S)
            await held.read()  # the first token: the stream is in flight on one replica
            victim, survivor = (a, b) if a.prompts else (b, a)
            survivor.gate.set()
            await victim.stop()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                while await held.read() is not grpc.aio.EOF:
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            before = len(survivor.prompts)
            finishes = [await complete(stub) for _ in range(4)]  # whether or not the watch noticed yet
            assert finishes == [common_pb2.FINISH_REASON_LENGTH] * 4
            assert len(survivor.prompts) - before == 4 and flips == [True]
            await until(lambda: num_ready(pool) == 1, "the dead replica out of the rotation")
            revived = FakeEngine("revived")
            await revived.start(victim.port)
            await until(lambda: num_ready(pool) == 2, "the revived replica back in the rotation")
            assert [await complete(stub) for _ in range(4)] == [common_pb2.FINISH_REASON_LENGTH] * 4
            assert len(revived.prompts) == 2
            await revived.stop()
        await survivor.stop()

    asyncio.run(scenario())


def test_a_replica_that_starts_draining_leaves_the_rotation_at_once_and_rejoins_when_it_serves(tiny_tokenizer):
    """The engine's health Watch tells each flip as it happens: no poll could, at one poll an hour."""
    async def scenario():
        engine = FakeEngine("a")
        async with served(tiny_tokenizer, await started(engine), Routing.ROUND_ROBIN,
                          watch_interval_s=3600) as (pool, flips, stub):
            await until(lambda: num_ready(pool) == 1, "the replica ready")
            await engine.set_serving(False)
            await until(lambda: num_ready(pool) == 0, "the draining replica out of the rotation")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await complete(stub)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and not engine.prompts
            await engine.set_serving(True)
            await until(lambda: num_ready(pool) == 1, "the replica back once it serves again")
            assert await complete(stub) == common_pb2.FINISH_REASON_LENGTH
            assert flips == [True, False, True]
        await engine.stop()

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def held_checks(engine: FakeEngine):
    """Stops `engine` on the way out, its GetEngineInfo released first (a handler left waiting hangs the exit)."""
    try:
        yield
    finally:
        engine.info_gate.set()
        await engine.stop()


def test_a_call_that_arrives_before_the_first_engine_check_waits_for_it(tiny_tokenizer):
    """The port opens before the first GetEngineInfo comes back (a --workers process gets connections at once):
    a call in that window is served once the check answers, not failed UNAVAILABLE while the engine is up."""
    async def scenario():
        engine = FakeEngine("a")
        engine.info_gate.clear()
        async with held_checks(engine), \
                served(tiny_tokenizer, await started(engine), Routing.ROUND_ROBIN) as (pool, flips, stub):
            call = asyncio.ensure_future(complete(stub))
            await until(lambda: engine.num_info_calls == 1, "the first check in flight")
            assert not call.done() and num_ready(pool) == 0 and flips == []
            engine.info_gate.set()
            assert await call == common_pb2.FINISH_REASON_LENGTH
            assert flips == [True] and len(engine.prompts) == 1

    asyncio.run(scenario())


def test_a_call_waits_for_the_first_checks_at_most_first_checks_wait_s(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(engine_pool, "FIRST_CHECKS_WAIT_S", 0.05)

    async def scenario():
        engine = FakeEngine("a")
        engine.info_gate.clear()  # the check hangs (until its own 2 s timeout)
        async with held_checks(engine), \
                served(tiny_tokenizer, await started(engine), Routing.ROUND_ROBIN) as (pool, _, stub):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await complete(stub)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no engine replica is available" in caught.value.details()
            assert engine.num_info_calls == 1 and not pool.members[engine.target].checked

    asyncio.run(scenario())


def test_no_call_waits_once_the_first_checks_found_no_engine_or_after_one_left(tiny_tokenizer, monkeypatch):
    """An engine that refuses connections at start-up, or one that was ready and went away: UNAVAILABLE at once
    (the wait, set longer than the call's deadline here, would turn it into DEADLINE_EXCEEDED)."""
    monkeypatch.setattr(engine_pool, "FIRST_CHECKS_WAIT_S", HANG_S)

    async def scenario():
        nobody = parse_targets([f"127.0.0.1:{free_port()}"])
        async with served(tiny_tokenizer, nobody, Routing.ROUND_ROBIN) as (pool, _, stub):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=HANG_S / 4).read()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert [member.checked for member in pool.members.values()] == [True]
        engine = FakeEngine("a")
        async with served(tiny_tokenizer, await started(engine), Routing.ROUND_ROBIN) as (pool, _, stub):
            await until(lambda: num_ready(pool) == 1, "the replica ready")
            await engine.set_serving(False)
            await until(lambda: num_ready(pool) == 0, "the draining replica out of the rotation")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=HANG_S / 4).read()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        await engine.stop()

    asyncio.run(scenario())


def test_a_replica_without_health_watch_is_polled_and_stays_in_the_rotation(tiny_tokenizer):
    async def scenario():
        engine = FakeEngine("older build", has_health=False)
        async with served(tiny_tokenizer, await started(engine), Routing.ROUND_ROBIN) as (pool, flips, stub):
            await until(lambda: engine.num_info_calls >= 5, "a few polls")
            assert num_ready(pool) == 1 and flips == [True]
            assert await complete(stub) == common_pb2.FINISH_REASON_LENGTH
            await engine.stop()
            await until(lambda: num_ready(pool) == 0, "the stopped replica out of the rotation")
            assert flips == [True, False]

    asyncio.run(scenario())


def test_a_replica_built_for_another_tokenizer_never_joins(tiny_tokenizer):
    async def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        b.fingerprint = "another-tokenizer"
        targets = await started(a, b)
        async with served(tiny_tokenizer, targets, Routing.ROUND_ROBIN) as (pool, flips, stub):
            await until(lambda: num_ready(pool) == 1, "the matching replica ready")
            assert [await complete(stub) for _ in range(4)] == [common_pb2.FINISH_REASON_LENGTH] * 4
            assert (len(a.prompts), len(b.prompts), flips) == (4, 0, [True])
            assert not pool.members[b.target].replica.ready
        await a.stop()
        await b.stop()

    asyncio.run(scenario())


def test_resource_exhausted_tries_each_other_replica_once_then_passes_the_status_on(tiny_tokenizer):
    async def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        targets = await started(a, b)
        async with served(tiny_tokenizer, targets, Routing.ROUND_ROBIN) as (pool, _, stub):
            await until(lambda: num_ready(pool) == 2, "both replicas ready")
            a.full = True
            assert [await complete(stub) for _ in range(2)] == [common_pb2.FINISH_REASON_LENGTH] * 2
            assert (len(a.prompts), len(b.prompts)) == (1, 2)  # the one sent to a went on to b
            b.full = True
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await complete(stub)
            assert (len(a.prompts), len(b.prompts)) == (2, 3)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            status = rpc_status.from_call(caught.value)
            assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
            assert all(m.replica.num_in_flight == 0 for m in pool.members.values())
        await a.stop()
        await b.stop()

    asyncio.run(scenario())


def test_a_name_is_resolved_again_as_replicas_come_and_go(tiny_tokenizer):
    async def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        await a.start()
        await b.start()
        answers: list = [[a.target]]
        calls: list[int] = []

        async def resolve(host: str, port: int) -> list[str]:
            assert (host, port) == ("engines.example", 50052)
            calls.append(len(answers))
            if isinstance(answers[-1], Exception):
                raise answers[-1]
            return answers[-1]

        clients: list[ClosingClient] = []

        def connect(address: str, fingerprint: str) -> ClosingClient:
            clients.append(ClosingClient(address, fingerprint))
            return clients[-1]

        targets = parse_targets(["engines.example:50052"])
        async with served(tiny_tokenizer, targets, Routing.LEAST_LOAD, resolve=resolve, connect=connect,
                          resolve_interval_s=WATCH_S) as (pool, _, stub):
            await until(lambda: num_ready(pool) == 1, "the first replica ready")
            answers.append([a.target, b.target])
            await until(lambda: num_ready(pool) == 2, "the second replica found and ready")
            a.gate.clear()
            b.num_queued = 50  # its GetLoad says it is busy: least-load sends the stream to a
            await until(lambda: pool.members[b.target].replica.num_reported == 50, "b's load polled")
            held = stub.Generate(request(), timeout=HANG_S)
            await held.read()
            assert len(a.prompts) == 1
            answers.append(socket.gaierror("temporary failure"))  # a failed lookup keeps what it had
            await until(lambda: calls.count(len(answers)) >= 2, "two failed lookups")
            assert set(pool.members) == {a.target, b.target}
            answers.append([b.target])
            await until(lambda: list(pool.members) == [b.target], "a gone from DNS")
            assert [client.closed for client in clients] == [False, False]  # a still has a stream to finish
            a.gate.set()
            while (last := await held.read()) is not grpc.aio.EOF:
                finish = last.finish_reason
            assert finish == common_pb2.FINISH_REASON_LENGTH
            await until(lambda: clients[0].closed, "a's channel closed once its stream ended")
            assert await complete(stub) == common_pb2.FINISH_REASON_LENGTH and len(b.prompts) == 1
        await a.stop()
        await b.stop()

    asyncio.run(scenario())


def test_prefix_routing_follows_each_replicas_kv_events_across_a_restart(tiny_tokenizer):
    async def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        hashes = prompt_block_hashes(PROMPT, BLOCK_SIZE)
        b.cached = hashes  # in b's snapshot
        targets = await started(a, b)
        async with served(tiny_tokenizer, targets, Routing.PREFIX) as (pool, _, stub):
            member_a, member_b = pool.members[a.target], pool.members[b.target]
            await until(lambda: member_b.replica.index.match(hashes) == 2, "b's snapshot indexed")
            await until(lambda: num_ready(pool) == 2, "both replicas ready")
            for _ in range(3):
                await complete(stub)
            assert (len(a.prompts), len(b.prompts)) == (0, 3)
            await b.stop()
            await until(lambda: not member_b.replica.ready, "b out of the rotation")
            revived = FakeEngine("b-revived")  # an empty cache on the same port
            await revived.start(b.port)
            await until(lambda: member_b.replica.ready and revived.kv_subscribers, "b resubscribed")
            a.publish(stored=hashes)
            await until(lambda: member_a.replica.index.match(hashes) == 2, "a's event indexed")
            assert member_b.replica.index.match(hashes) == 0  # the old cache went with the old process
            for _ in range(3):
                await complete(stub)
            assert (len(a.prompts), len(revived.prompts)) == (3, 0)
            await revived.stop()
        await a.stop()

    asyncio.run(scenario())

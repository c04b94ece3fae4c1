"""The tokenizer service's GenerateBatch client (services.tokenizer.serving.engine_batch) against scripted engines.

Which call a request takes, how an errors entry becomes the AioRpcError a Generate call would have raised,
what a cancel sends (and what it must not), the fallback to Generate calls on an engine without GenerateBatch,
and a call that ends under its requests. Each engine is an in-process grpc.aio server.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from services.common.errors import InvalidRequestError, QueueFullError
from services.common.grpc_server import status_for
from services.tokenizer.serving.engine_client import EngineClient, is_retryable_elsewhere, upstream_error

WAIT_S = 30.0


def request(request_id: str, n: int | None = None) -> engine_pb2.GenerateRequest:
    message = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2])
    if n is not None:
        message.sampling.n = n
    return message


def finished(request_id: str, ids: list[int], index: int = 0) -> engine_pb2.GenerateResponse:
    return engine_pb2.GenerateResponse(request_id=request_id, token_ids=ids, index=index,
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH)


class ScriptedEngine(engine_pb2_grpc.EngineServiceServicer):
    """Answers each request with `answer(request)` (a GenerateBatchResponse, or None to hold it), records what
    arrived on which RPC, and can end its batch calls with a status."""

    def __init__(self, answer):
        self.answer = answer
        self.batch_requests: list[engine_pb2.GenerateRequest] = []
        self.generate_requests: list[engine_pb2.GenerateRequest] = []
        self.cancels: list[str] = []
        self.log: list[tuple[str, str]] = []
        self.messages_seen = asyncio.Event()
        self.end_calls: asyncio.Future | None = None

    async def Generate(self, request, context):
        self.generate_requests.append(request)
        yield finished(request.request_id, [7, 8])

    async def GenerateBatch(self, request_iterator, context):
        await context.send_initial_metadata(())  # as the engine does (the client waits for it)
        self.end_calls = asyncio.get_running_loop().create_future()
        reader = asyncio.ensure_future(self._read(request_iterator, context))
        code, details = await self.end_calls
        reader.cancel()
        await context.abort(code, details)

    async def _read(self, request_iterator, context):
        async for message in request_iterator:
            self.batch_requests += message.requests
            self.cancels += message.cancel_request_ids
            self.log += [("request", r.request_id) for r in message.requests]  # applied in this order
            self.log += [("cancel", request_id) for request_id in message.cancel_request_ids]
            self.messages_seen.set()
            for each in message.requests:
                reply = self.answer(each)
                if reply is not None:
                    await context.write(reply)


class GenerateOnlyEngine(engine_pb2_grpc.EngineServiceServicer):
    """An engine built before GenerateBatch: UNIMPLEMENTED for it."""

    def __init__(self):
        self.generate_requests = []

    async def Generate(self, request, context):
        self.generate_requests.append(request)
        yield finished(request.request_id, [7, 8])


async def serving(servicer):
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def client_of(servicer):
    """A batched EngineClient of `servicer`, served in process; both closed on leaving."""
    server, target = await serving(servicer)
    client = EngineClient(target, "fp")
    try:
        yield client
    finally:
        await client.close()
        await server.stop(None)


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


async def read_all(stream) -> list[int]:
    ids = []
    while True:
        new_ids, last = await stream.take()
        if last is None:
            return ids
        ids += new_ids
        if last.finish_reason:
            return ids


def test_requests_share_the_batch_call_and_per_request_mode_uses_generate():
    async def scenario():
        engine = ScriptedEngine(lambda r: engine_pb2.GenerateBatchResponse(responses=[finished(r.request_id, [3])]))
        server, target = await serving(engine)
        batched, single = EngineClient(target, "fp"), EngineClient(target, "fp", batched=False)
        try:
            streams = [batched.open_stream(request(f"r{i}"), None) for i in range(3)]
            assert [await read_all(stream) for stream in streams] == [[3], [3], [3]]
            assert [r.request_id for r in engine.batch_requests] == ["r0", "r1", "r2"]
            assert await read_all(single.open_stream(request("alone"), None)) == [7, 8]
            assert [r.request_id for r in engine.generate_requests] == ["alone"]
        finally:
            await batched.close()
            await single.close()
            await server.stop(None)

    run(scenario)


@pytest.mark.parametrize("error, retryable", [(InvalidRequestError("sampling.top_p", "must be in (0, 1]"), False),
                                              (QueueFullError("queue full", retry_after_s=2.0), True)])
def test_an_errors_entry_raises_what_its_generate_call_would(error, retryable):
    status = status_for(error)

    def answer(r):
        failed = engine_pb2.RequestError(request_id=r.request_id)
        failed.status.ParseFromString(status.SerializeToString())
        return engine_pb2.GenerateBatchResponse(errors=[failed])

    async def scenario():
        async with client_of(ScriptedEngine(answer)) as client:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.open_stream(request("bad"), None).take()
            assert caught.value.code().value[0] == status.code
            assert caught.value.details() == status.message
            assert is_retryable_elsewhere(caught.value) is retryable
            assert upstream_error(caught.value).status == status  # the client gets the engine's status as it is

    run(scenario)


def test_a_cancel_is_sent_for_a_live_request_and_never_for_a_finished_one():
    async def scenario():
        # "done" finishes at once; "live" gets one message and is held; "pair" (n=2) finishes one of two
        def answer(r):
            if r.request_id == "done":
                return engine_pb2.GenerateBatchResponse(responses=[finished("done", [1])])
            if r.request_id == "pair":
                return engine_pb2.GenerateBatchResponse(responses=[finished("pair", [1], index=1)])
            return engine_pb2.GenerateBatchResponse(responses=[engine_pb2.GenerateResponse(
                request_id=r.request_id, token_ids=[5])])

        engine = ScriptedEngine(answer)
        async with client_of(engine) as client:
            done, live, pair = (client.open_stream(request("done"), None), client.open_stream(request("live"), None),
                                client.open_stream(request("pair", n=2), None))
            assert await read_all(done) == [1]
            assert (await live.take())[0] == [5]
            assert (await pair.take())[0] == [1]
            for stream in (done, live, pair):
                stream.cancel()
            again = client.open_stream(request("done"), None)  # the ids are free again: reused at once
            live_again = client.open_stream(request("live"), None)
            assert await read_all(again) == [1]
            assert (await live_again.take())[0] == [5]
            assert sorted(engine.cancels) == ["live", "pair"]
            # a message applies its requests, then its cancels: the reused "live" must come in a later message
            assert engine.log[3:] == [("request", "done"), ("cancel", "live"), ("cancel", "pair"), ("request", "live")]

    run(scenario)


def test_an_engine_without_generate_batch_gets_generate_calls_for_the_same_requests():
    async def scenario():
        engine = GenerateOnlyEngine()
        async with client_of(engine) as client:
            assert await read_all(client.open_stream(request("first"), None)) == [7, 8]  # re-sent, not failed
            assert await read_all(client.open_stream(request("second"), None)) == [7, 8]
            assert [r.request_id for r in engine.generate_requests] == ["first", "second"]

    run(scenario)


def test_a_call_that_ends_fails_its_requests_with_its_status_and_the_next_request_reconnects():
    async def scenario():
        engine = ScriptedEngine(lambda r: engine_pb2.GenerateBatchResponse(responses=[engine_pb2.GenerateResponse(
            request_id=r.request_id, token_ids=[4])]) if r.request_id == "held" else
            engine_pb2.GenerateBatchResponse(responses=[finished(r.request_id, [9])]))
        async with client_of(engine) as client:
            held = client.open_stream(request("held"), None)
            assert (await held.take())[0] == [4]
            engine.end_calls.set_result((grpc.StatusCode.UNAVAILABLE, "engine restarting"))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await held.take()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert await read_all(client.open_stream(request("next"), None)) == [9]

    run(scenario)



def test_a_burst_of_requests_is_split_into_messages_the_engine_accepts():
    from services.tokenizer.serving.engine_batch import MESSAGE_BUDGET_BYTES

    sizes = []

    class SizingEngine(ScriptedEngine):
        async def _read(self, request_iterator, context):
            async for message in request_iterator:
                sizes.append(message.ByteSize())
                for each in message.requests:
                    await context.write(engine_pb2.GenerateBatchResponse(responses=[finished(each.request_id, [1])]))

    def long_request(request_id: str, num_ids: int) -> engine_pb2.GenerateRequest:
        return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[40_000] * num_ids)  # 3 bytes each

    async def scenario():
        async with client_of(SizingEngine(None)) as client:
            burst = [client.open_stream(long_request(f"r{i}", 3_000), None) for i in range(30)]  # ~9 KB each
            huge = client.open_stream(long_request("huge", 30_000), None)  # ~90 KB: over the budget, alone
            assert [await read_all(stream) for stream in [*burst, huge]] == [[1]] * 31
            assert len(sizes) >= 6
            assert max(size for size in sizes if size < 80_000) <= MESSAGE_BUDGET_BYTES
            assert sum(size > MESSAGE_BUDGET_BYTES for size in sizes) == 1  # the huge one, by itself

    run(scenario)

"""A burst of calls larger than gRPC's default pending-call limits: every call is served, none CANCELLED.

grpc.aio takes up one new call per event-loop turn; calls that arrive faster wait in gRPC's pending queue,
which by default refuses some calls past 1,000 and all past 3,000, as CANCELLED with no reason (measured: 2,000
calls at once against a bare grpc.aio server, ~150 CANCELLED within the first second). build_server raises the
limits (services/common/grpc_server.py, MAX_PENDING_CALLS). The server here spends 2 ms of blocking work per
call, as tokenizing does, so the queue passes 1,000 on any machine.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import time

import grpc
import pytest

from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from tests.services.procs import TEXTGEN_SERVICE

NUM_CALLS = 2_500
NUM_CHANNELS = 8
WORK_PER_CALL_S = 0.002
CALL_TIMEOUT_S = 120.0


def _serve(ports: multiprocessing.Queue) -> None:
    from services.common.grpc_server import ServingState, build_server

    async def generate(request, context):
        time.sleep(WORK_PER_CALL_S)  # blocks the event loop, as a tokenization does
        for index in range(2):
            await asyncio.sleep(0.01)
            await context.write(textgen_pb2.GenerateResponse(text="ab", token_ids=[index]))

    async def main() -> None:
        servicer = textgen_pb2_grpc.TextGenerationServiceServicer()
        servicer.Generate = generate
        server = build_server([TEXTGEN_SERVICE], ServingState(TEXTGEN_SERVICE),
                              lambda s: textgen_pb2_grpc.add_TextGenerationServiceServicer_to_server(servicer, s))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


async def _burst(port: int) -> collections.Counter:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(NUM_CHANNELS)]
    stubs = [textgen_pb2_grpc.TextGenerationServiceStub(channel) for channel in channels]
    codes: collections.Counter = collections.Counter()

    async def one(index: int) -> None:
        call = stubs[index % NUM_CHANNELS].Generate(textgen_pb2.GenerateRequest(text="a"), timeout=CALL_TIMEOUT_S)
        try:
            messages = [message async for message in call]
            codes["OK" if len(messages) == 2 else f"{len(messages)} messages"] += 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1

    try:
        await asyncio.gather(*(one(index) for index in range(NUM_CALLS)))
    finally:
        for channel in channels:
            await channel.close()
    return codes


@pytest.mark.timeout(300)
def test_a_burst_past_grpcs_default_pending_limits_is_served_whole():
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: forking after grpc use hangs
    ports = context.Queue()
    server = context.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        codes = asyncio.run(_burst(ports.get(timeout=60)))
    finally:
        server.kill()
        server.join()
    assert codes == {"OK": NUM_CALLS}

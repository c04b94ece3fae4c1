"""run_until_signalled's drain in process: what counts as in flight, and what happens at the grace period.

A health Watch stream (held open by a Kubernetes-style watcher) must not hold the drain up; a Generate stream
that outlives the grace period is cancelled and the drain returns. Gated on events; the only clock is the
grace period itself, which the test never measures.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from services.common.grpc_server import ServingState, build_server, run_until_signalled
from services.engine.serving.server import SERVICE_NAME

WAIT_S = 60.0


class HeldEngine(engine_pb2_grpc.EngineServiceServicer):
    """Generate sends one message, then waits for `release` (never set in these tests)."""

    def __init__(self):
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        yield engine_pb2.GenerateResponse(request_id=request.request_id)
        self.started.set()
        await self.release.wait()


async def serve(grace_s: float):
    engine = HeldEngine()
    state = ServingState(SERVICE_NAME)
    server = build_server([SERVICE_NAME], state, lambda s: engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, s))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await state.mark_alive()
    await state.mark_ready()
    drain = asyncio.create_task(run_until_signalled(server, state, grace_s, handle_sigint=False))
    await asyncio.sleep(0)  # run_until_signalled installs its SIGTERM handler before its first await
    return engine, state, f"127.0.0.1:{port}", drain, server


async def stop(drain: asyncio.Task, server: grpc.aio.Server) -> None:
    """After a failed assertion: leave nothing serving (a no-op once the drain has ended)."""
    if not drain.done():
        drain.cancel()
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        await server.stop(None)


def test_a_health_watch_does_not_hold_up_the_drain():
    async def scenario():
        _, state, target, drain, server = await serve(grace_s=3600.0)
        try:
            await watch_through_the_drain(state, target, drain)
        finally:
            await stop(drain, server)

    async def watch_through_the_drain(state, target, drain):
        async with grpc.aio.insecure_channel(target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            assert state.num_in_flight == 0
            os.kill(os.getpid(), signal.SIGTERM)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await asyncio.wait_for(drain, WAIT_S)  # not the hour of grace

    asyncio.run(scenario())


def test_a_stream_past_the_grace_period_is_cancelled_and_the_drain_ends():
    async def scenario():
        engine, state, target, drain, server = await serve(grace_s=0.5)
        try:
            await hold_past_the_grace(engine, state, target, drain)
        finally:
            await stop(drain, server)

    async def hold_past_the_grace(engine, state, target, drain):
        async with grpc.aio.insecure_channel(target) as channel:
            call = engine_pb2_grpc.EngineServiceStub(channel).Generate(engine_pb2.GenerateRequest(request_id="held"))
            await call.read()
            await asyncio.wait_for(engine.started.wait(), WAIT_S)
            assert state.num_in_flight == 1
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(drain, WAIT_S)
            assert state.draining and state.num_in_flight == 0
            assert await call.code() != grpc.StatusCode.OK

    asyncio.run(scenario())

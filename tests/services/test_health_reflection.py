"""grpc.health.v1 and server reflection on both real services, and ServingState's flips in-process."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from llmserve.engine.v1 import engine_pb2
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from services.common.grpc_server import ServingState, build_server
from tests.services.procs import ENGINE_SERVICE, TEXTGEN_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
GENERATED = {
    ENGINE_SERVICE: engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
    TEXTGEN_SERVICE: textgen_pb2.DESCRIPTOR.services_by_name["TextGenerationService"],
}


def targets(stack) -> dict[str, str]:
    return {ENGINE_SERVICE: stack.engine_target, TEXTGEN_SERVICE: stack.tokenizer_target}


@pytest.mark.slow
@pytest.mark.parametrize("service", [ENGINE_SERVICE, TEXTGEN_SERVICE], ids=["engine", "tokenizer"])
def test_health_is_serving_for_the_server_and_the_service(stack, service):
    with grpc.insecure_channel(targets(stack)[service]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == SERVING
        with pytest.raises(grpc.RpcError) as caught:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.slow
@pytest.mark.parametrize("service", [ENGINE_SERVICE, TEXTGEN_SERVICE], ids=["engine", "tokenizer"])
def test_reflection_lists_and_describes_the_services(stack, service):
    with grpc.insecure_channel(targets(stack)[service]) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {service, HEALTH_SERVICE, REFLECTION_SERVICE} <= set(database.get_services())
        described = descriptor_pool.DescriptorPool(database).FindServiceByName(service)
        generated = GENERATED[service]
        assert {m.name: (m.input_type.full_name, m.output_type.full_name) for m in described.methods} == {
            m.name: (m.input_type.full_name, m.output_type.full_name) for m in generated.methods}


async def _check(stub: health_pb2_grpc.HealthStub, name: str) -> int | grpc.StatusCode:
    try:
        return (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
    except grpc.aio.AioRpcError as error:
        return error.code()


def test_serving_state_is_ready_only_between_warm_up_and_draining():
    async def scenario() -> list[tuple[int | grpc.StatusCode, int | grpc.StatusCode]]:
        state = ServingState(ENGINE_SERVICE)
        server = build_server([ENGINE_SERVICE], state, lambda server: None)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def observe() -> None:
                    seen.append((await _check(stub, ""), await _check(stub, ENGINE_SERVICE)))

                await observe()
                await state.mark_alive()
                await observe()
                await state.mark_ready()
                await observe()
                await state.mark_ready(False)
                await observe()
                await state.mark_ready()
                await state.mark_draining()
                await observe()
                await state.mark_ready()  # a late readiness report must not undo draining
                await observe()
        finally:
            await server.stop(None)
        assert state.draining
        return seen

    assert asyncio.run(scenario()) == [
        (SERVING, grpc.StatusCode.NOT_FOUND),  # started, not yet marked
        (SERVING, NOT_SERVING),  # alive: listening, warming up
        (SERVING, SERVING),  # warmed up
        (SERVING, NOT_SERVING),  # the dependency went away
        (NOT_SERVING, NOT_SERVING),  # draining
        (NOT_SERVING, NOT_SERVING),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("service", [ENGINE_SERVICE, TEXTGEN_SERVICE], ids=["engine", "tokenizer"])
def test_watch_streams_serving_on_the_real_services(stack, service):
    with grpc.insecure_channel(targets(stack)[service]) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert next(watch).status == SERVING
        watch.cancel()


def health_checked_channel(target: str, service: str) -> grpc.aio.Channel:
    """A channel that routes calls only while Watch(service) says SERVING (client-side health checking)."""
    config = {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": service}}
    return grpc.aio.insecure_channel(target, options=[("grpc.service_config", json.dumps(config))])


@pytest.mark.slow
def test_a_health_checked_channel_can_call_the_tokenizer_service(stack):
    async def call() -> int:
        async with health_checked_channel(stack.tokenizer_target, TEXTGEN_SERVICE) as channel:
            stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
            reply = await stub.GetModelInfo(textgen_pb2.GetModelInfoRequest(), timeout=10, wait_for_ready=True)
            return reply.vocab_size

    assert asyncio.run(call()) > 0


def test_watch_follows_readiness_and_gates_a_health_checked_channel():
    async def scenario() -> tuple[list[int], list[bool]]:
        state = ServingState(REFLECTION_SERVICE)
        server = build_server([], state, lambda server: None)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await state.mark_alive()
        target = f"127.0.0.1:{port}"
        try:
            async with grpc.aio.insecure_channel(target) as plain, health_checked_channel(target, state.service_name) \
                    as checked:
                watch = health_pb2_grpc.HealthStub(plain).Watch(health_pb2.HealthCheckRequest(service=state.service_name))
                seen = [(await watch.read()).status]
                routed = [await _routes(checked)]
                await state.mark_ready()
                seen.append((await watch.read()).status)
                routed.append(await _routes(checked, wait_for_ready=True))
                await state.mark_ready(False)
                seen.append((await watch.read()).status)
                watch.cancel()
        finally:
            await server.stop(None)
        return seen, routed

    assert asyncio.run(scenario()) == ([NOT_SERVING, SERVING, NOT_SERVING], [False, True])


async def _routes(channel: grpc.aio.Channel, wait_for_ready: bool = False) -> bool:
    """Whether a call on `channel` reaches the server (reflection answers; an unhealthy channel fails fast)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5, wait_for_ready=wait_for_ready)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        return False
    return True

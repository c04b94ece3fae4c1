"""The tokenizer service passes the engine's RESOURCE_EXHAUSTED on unchanged: code, message and RetryInfo,
before any message (trying another replica first is the multi-engine router's business)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from llmserve.textgen.v1 import textgen_pb2_grpc
from tests.services import test_tokenizer_limits as limits_tests
from tests.services.test_tokenizer_limits import base_tokenizer, generate_request, start_stack  # noqa: F401

RETRY_DELAY_S = 2.5


class FullEngine(limits_tests.FakeEngine):
    """A fake engine whose waiting queue is always full."""

    async def Generate(self, request, context):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(RETRY_DELAY_S * 1e9))
        status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="waiting queue is full (4 requests)")
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        await context.abort_with_status(rpc_status.to_status(status))
        yield  # an async generator, like the real servicer


def test_a_full_engine_queue_reaches_the_client_unchanged(base_tokenizer, monkeypatch):  # noqa: F811
    monkeypatch.setattr(limits_tests, "FakeEngine", FullEngine)

    async def scenario() -> None:
        _, target, servers, _ = await start_stack(base_tokenizer)
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                call = textgen_pb2_grpc.TextGenerationServiceStub(channel).Generate(generate_request(text="Hi"))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call.read()  # the very first read fails: nothing was sent before the error
        finally:
            for server in servers:
                await server.stop(None)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert caught.value.details() == "waiting queue is full (4 requests)"
        [detail] = rpc_status.from_call(caught.value).details
        retry = error_details_pb2.RetryInfo()
        assert detail.Unpack(retry) and retry.retry_delay.ToTimedelta().total_seconds() == RETRY_DELAY_S

    asyncio.run(scenario())

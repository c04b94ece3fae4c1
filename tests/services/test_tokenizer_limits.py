"""The tokenizer service under oversized or slow input: rejected before tokenizing, or tokenized off the event loop.

The service runs in-process in front of a scripted fake engine, so each step is gated on an event, not on time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from services.common.grpc_server import ServingState, build_server
from services.tokenizer.serving.engine_client import EngineClient
from services.tokenizer.limits import INLINE_MAX_CHARS, InputLimits
from services.tokenizer.serving.server import SERVICE_NAME, TextGenerationServicer
from services.tokenizer.tokenizer import TextTokenizer
from tests.services.helpers import field_violations

MAX_MODEL_LEN = 256
WAIT_S = 30.0


class FakeEngine(engine_pb2_grpc.EngineServiceServicer):
    """Answers GetEngineInfo for `tokenizer`; each Generate streams the ids the test puts in its queue."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.streams: asyncio.Queue[asyncio.Queue] = asyncio.Queue()

    async def GetEngineInfo(self, request, context):
        return engine_pb2.GetEngineInfoResponse(model_name="fake", max_model_len=MAX_MODEL_LEN,
                                                tokenizer_fingerprint=self.fingerprint)

    async def Generate(self, request, context) -> AsyncIterator[engine_pb2.GenerateResponse]:
        ids: asyncio.Queue = asyncio.Queue()
        await self.streams.put(ids)
        num_generated = 0
        while (token_id := await ids.get()) is not None:
            num_generated += 1
            yield engine_pb2.GenerateResponse(request_id=request.request_id, token_ids=[token_id],
                                              usage=common_pb2.Usage(completion_tokens=num_generated))
        yield engine_pb2.GenerateResponse(request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                          usage=common_pb2.Usage(completion_tokens=num_generated))


def longest_token_text(tokenizer: TextTokenizer, count: int) -> str:
    """The text of `count` copies of the vocabulary's longest token (as few tokens as text can be)."""
    lengths = [len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size)]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    return tokenizer.decode([longest] * count, skip_special_tokens=False)


class BlockingTokenizer(TextTokenizer):
    """Encoding `blocking_prompt` waits (in whatever thread runs it) until `release` is set."""

    def __init__(self, base: TextTokenizer):
        super().__init__(base.hf_tokenizer, base.source)
        self.blocking_prompt = longest_token_text(base, MAX_MODEL_LEN // 2)
        assert len(self.blocking_prompt) > INLINE_MAX_CHARS  # so it is tokenized in a thread
        self.started = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text == self.blocking_prompt:
            self.started.set()
            assert self.release.wait(WAIT_S), "never released"
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    TextTokenizer.load(None).hf_tokenizer.save_pretrained(str(path))
    return TextTokenizer.load(str(path))


async def start_stack(tokenizer: TextTokenizer):
    """(fake engine, tokenizer-service target, servers to stop), the tokenizer service ready."""
    engine = FakeEngine(tokenizer.fingerprint())
    engine_server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, engine_server)
    engine_port = engine_server.add_insecure_port("127.0.0.1:0")
    await engine_server.start()
    client = EngineClient(f"127.0.0.1:{engine_port}", tokenizer.fingerprint())
    assert await client.check()
    limits = InputLimits.of(tokenizer)
    state = ServingState(SERVICE_NAME)
    servicer = TextGenerationServicer(tokenizer, client, state, 16, limits)
    server = build_server([SERVICE_NAME], state, servicer.register,
                          max_receive_bytes=limits.receive_bytes(MAX_MODEL_LEN))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await state.mark_alive()
    await state.mark_ready()
    return engine, f"127.0.0.1:{port}", [server, engine_server], limits


def generate_request(**prompt) -> textgen_pb2.GenerateRequest:
    request = textgen_pb2.GenerateRequest(**prompt)
    request.sampling.max_tokens = 8
    return request


async def read_all(call) -> list[textgen_pb2.GenerateResponse]:
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def test_long_tokenization_leaves_other_streams_and_health_flowing(base_tokenizer):
    tokenizer = BlockingTokenizer(base_tokenizer)

    async def scenario() -> None:
        engine, target, servers, _ = await start_stack(tokenizer)
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
                flowing = stub.Generate(generate_request(text="Hello"))
                flowing_ids = await asyncio.wait_for(engine.streams.get(), WAIT_S)
                blocked = stub.Generate(generate_request(text=tokenizer.blocking_prompt))
                assert await asyncio.to_thread(tokenizer.started.wait, WAIT_S)
                # The blocked prompt is being tokenized: the other stream and health still answer.
                await flowing_ids.put(42)
                assert list((await asyncio.wait_for(flowing.read(), WAIT_S)).token_ids) == [42]
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                tokenizer.release.set()
                blocked_ids = await asyncio.wait_for(engine.streams.get(), WAIT_S)
                for ids in (flowing_ids, blocked_ids):
                    await ids.put(None)
                for call in (flowing, blocked):
                    assert (await read_all(call))[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        finally:
            tokenizer.release.set()
            for server in servers:
                await server.stop(None)

    asyncio.run(scenario())


def oversized_requests(limits: InputLimits) -> dict[str, textgen_pb2.GenerateRequest]:
    max_chars = limits.max_chars_per_token * MAX_MODEL_LEN
    many = textgen_pb2.ChatMessages(messages=[textgen_pb2.ChatMessage(role="user", content="")] * (MAX_MODEL_LEN + 1))
    long_content = textgen_pb2.ChatMessages(messages=[textgen_pb2.ChatMessage(role="user", content="a" * max_chars),
                                                      textgen_pb2.ChatMessage(role="user", content="b")])
    return {
        "text": generate_request(text="a" * (max_chars + 1)),
        "chat.messages": generate_request(chat=many),
        "chat.messages ": generate_request(chat=long_content),
        "token_ids": generate_request(token_ids=textgen_pb2.TokenIds(ids=[10**9] * (MAX_MODEL_LEN + 1))),
    }


def test_oversized_prompts_are_rejected_before_tokenizing(base_tokenizer, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("tokenized an oversized prompt")

    async def scenario() -> None:
        _, target, servers, limits = await start_stack(base_tokenizer)
        for method in ("encode", "apply_chat_template"):
            monkeypatch.setattr(base_tokenizer, method, never)
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
                for field, request in oversized_requests(limits).items():
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.Generate(request).read()
                    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
                    assert field_violations(caught.value) == [field.strip()]
                too_big = "a" * (limits.receive_bytes(MAX_MODEL_LEN) + 1)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Generate(generate_request(text=too_big)).read()
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for server in servers:
                await server.stop(None)

    asyncio.run(scenario())


def test_the_character_limit_never_rejects_a_prompt_that_fits(base_tokenizer):
    """The text of max_model_len of the vocabulary's longest tokens is within the limit."""
    limits = InputLimits.of(base_tokenizer)
    text = longest_token_text(base_tokenizer, MAX_MODEL_LEN)
    assert len(base_tokenizer.encode(text, add_special_tokens=False)) <= MAX_MODEL_LEN
    limits.check_prompt(textgen_pb2.GenerateRequest(text=text), MAX_MODEL_LEN)

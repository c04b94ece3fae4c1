"""An in-process EngineService for the router tests: a grpc.aio server on 127.0.0.1 whose answers the test
scripts (tokens per request, a gate that holds streams open, RESOURCE_EXHAUSTED, load, KV events)."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from services.common.errors import QueueFullError
from services.common.grpc_server import status_for
from tests.services.procs import ENGINE_SERVICE

BLOCK_SIZE = 4
MAX_MODEL_LEN = 512
FIRST_TOKEN_ID = 2  # the tiny word-level tokenizer's first word


class FakeEngine(engine_pb2_grpc.EngineServiceServicer):
    """Scripted engine. Generate sends `num_tokens` tokens; while `gate` is clear it holds each stream after
    its first token; with `full` set it refuses with RESOURCE_EXHAUSTED + RetryInfo before any message.
    With `has_health` it serves grpc.health.v1 too (SERVING until set_serving(False)), as the engine does."""

    def __init__(self, name: str, num_tokens: int = 3, has_health: bool = True):
        self.name = name
        self.health = health.aio.HealthServicer() if has_health else None
        self.num_tokens = num_tokens
        self.gate = asyncio.Event()
        self.gate.set()
        self.full = False
        self.fingerprint = ""  # "" = unknown tokenizer (accepted); anything else must match the router's
        self.num_queued = 0
        self.cached: list[int] = []  # the snapshot a new KV subscriber gets
        self.kv_subscribers: list[asyncio.Queue] = []
        self.prompts: list[list[int]] = []  # every Generate's prompt ids, in arrival order
        self.first_sent = asyncio.Event()  # set when some stream has sent its first message
        self.num_info_calls = 0
        self.info_gate = asyncio.Event()  # GetEngineInfo answers only while set (a slow first check)
        self.info_gate.set()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> str:
        self.server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self, self.server)
        if self.health is not None:
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
            await self.set_serving(True)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return self.target

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        """The engine service's health, as a drain (False) or its end (True) sets it."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(ENGINE_SERVICE, status)

    async def stop(self) -> None:
        """As a SIGKILL looks from outside: open streams break, the port stops answering."""
        self.kv_subscribers.clear()
        await self.server.stop(None)

    async def Generate(self, request, context):
        self.prompts.append(list(request.prompt_token_ids))
        if self.full:
            status = rpc_status.to_status(status_for(QueueFullError(f"{self.name} is full", 0.5)))
            await context.abort_with_status(status)
        for index in range(self.num_tokens):
            last = index == self.num_tokens - 1
            finish = common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED
            yield engine_pb2.GenerateResponse(request_id=request.request_id, token_ids=[FIRST_TOKEN_ID + index],
                                              finish_reason=finish, usage=common_pb2.Usage(completion_tokens=index + 1))
            if index == 0:
                self.first_sent.set()
                await self.gate.wait()

    async def GetEngineInfo(self, request, context):
        self.num_info_calls += 1
        await self.info_gate.wait()
        return engine_pb2.GetEngineInfoResponse(model_name=self.name, vocab_size=64, max_model_len=MAX_MODEL_LEN,
                                                block_size=BLOCK_SIZE, num_total_blocks=64,
                                                tokenizer_fingerprint=self.fingerprint)

    async def GetLoad(self, request, context):
        return engine_pb2.LoadReport(num_running=self.num_queued)

    async def SubscribeKvEvents(self, request, context):
        queue: asyncio.Queue = asyncio.Queue()
        self.kv_subscribers.append(queue)
        yield engine_pb2.SubscribeKvEventsResponse(snapshot=True, stored_block_hashes=self.cached,
                                                   block_size=BLOCK_SIZE)
        while True:
            yield await queue.get()

    def publish(self, stored: list[int] = (), removed: list[int] = ()) -> None:
        """One KV event to every subscriber (and into the snapshot later subscribers get)."""
        self.cached = [h for h in self.cached if h not in removed] + list(stored)
        event = engine_pb2.SubscribeKvEventsResponse(stored_block_hashes=stored, removed_block_hashes=removed,
                                                     block_size=BLOCK_SIZE)
        for queue in self.kv_subscribers:
            queue.put_nowait(event)

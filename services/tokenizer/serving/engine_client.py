"""The tokenizer service's view of one engine replica: a channel, a readiness watch, its load and KV events,
errors mapped to typed ones."""

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc

from services.common.errors import UnavailableError, UpstreamStatusError
from services.common.grpc_server import CLIENT_OPTIONS

logger = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 5.0  # an Abort is answered between two engine steps
ENGINE_SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING

# Reconnect quickly after the engine restarts instead of gRPC's default backoff of up to two minutes.
_CHANNEL_OPTIONS = CLIENT_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class EngineClient:
    """Calls the engine service and tracks whether it is reachable and built for our tokenizer."""

    def __init__(self, target: str, fingerprint: str, batched: bool = True):
        """batched: send requests on one shared GenerateBatch call (services.tokenizer.serving.engine_batch) rather
        than a Generate call each."""
        self.target = target
        self.fingerprint = fingerprint
        self.channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._batch = None
        if batched:
            from services.tokenizer.serving.engine_batch import BatchCall  # it builds on EngineStream, below

            self._batch = BatchCall(self.stub, target)
        self.info: engine_pb2.GetEngineInfoResponse | None = None
        self.ready = asyncio.Event()

    async def check(self, timeout_s: float = 2.0) -> bool:
        """Fetch GetEngineInfo; ready only when the engine answers and its tokenizer matches ours."""
        try:
            info = await self.stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._set_ready(False, f"engine {self.target} unreachable: {exc.code().name}")
            return False
        if info.tokenizer_fingerprint and info.tokenizer_fingerprint != self.fingerprint:
            self._set_ready(False, f"engine tokenizer {info.tokenizer_fingerprint} != ours {self.fingerprint}")
            return False
        self.info = info
        self._set_ready(True, f"engine {self.target} serves {info.model_name}")
        return True

    async def follow_serving(self, on_ready) -> str:
        """Follow the engine's grpc.health.v1 Watch of its service until the stream ends: each status it sends
        becomes on_ready(ready), at once (a drain starting is seen as it starts); a SERVING one is confirmed with
        check(). Returns the status code name the stream ended with (UNIMPLEMENTED: an engine without Watch)."""
        call = self._health.Watch(health_pb2.HealthCheckRequest(service=ENGINE_SERVICE_NAME))
        try:
            async for response in call:
                if response.status == _SERVING:
                    ready = await self.check()
                else:
                    ready = False
                    self._set_ready(False, f"engine {self.target} is not serving (draining or not started)")
                await on_ready(ready)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        finally:
            call.cancel()
        return grpc.StatusCode.OK.name

    def _set_ready(self, ready: bool, message: str) -> None:
        if ready != self.ready.is_set():
            logger.info(message) if ready else logger.warning(message)
        self.ready.set() if ready else self.ready.clear()

    def require_info(self) -> engine_pb2.GetEngineInfoResponse:
        if self.info is None or not self.ready.is_set():
            raise UnavailableError(f"engine {self.target} is not available")
        return self.info

    def open_stream(self, request: engine_pb2.GenerateRequest, timeout_s: float | None) -> "EngineStream":
        """Start generating; on the shared batch call the caller's deadline is enforced by cancelling."""
        if self._batch is not None and not self._batch.unsupported:
            return self._batch.open(request)
        return EngineStream(self.stub.Generate(request, timeout=timeout_s))

    async def abort_completion(self, request_id: str, index: int, timeout_s: float = ABORT_TIMEOUT_S) -> bool:
        """Ask the engine to stop generating one completion of an n > 1 request (a stop string ended its text
        here) while its siblings go on. False when the engine could not be told (logged): that costs only the
        compute of the tokens nobody reads, and the whole request is aborted when its call ends anyway."""
        ref = engine_pb2.CompletionRef(request_id=request_id, index=index)
        try:
            await self.stub.Abort(engine_pb2.AbortRequest(completions=[ref]), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning("engine %s did not abort completion %d of %s: %s", self.target, index, request_id,
                           exc.code().name)
            return False
        return True

    async def num_queued(self, timeout_s: float = 2.0) -> int | None:
        """running + waiting from GetLoad, or None when the engine does not answer."""
        try:
            load = await self.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None
        return load.num_running + load.num_waiting

    async def follow_kv_events(self, on_event) -> None:
        """Call on_event(snapshot, stored, removed, num_queued or None) per SubscribeKvEvents message, until the
        stream ends; raises KvEventsEnded(unimplemented) when it does (the engine went away, or never had it)."""
        call = self.stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest())
        try:
            async for event in call:
                queued = event.load.num_running + event.load.num_waiting if event.HasField("load") else None
                on_event(event.snapshot, event.stored_block_hashes, event.removed_block_hashes, queued)
        except grpc.aio.AioRpcError as exc:
            raise KvEventsEnded(exc.code().name) from None
        finally:
            call.cancel()
        raise KvEventsEnded("OK")

    async def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
        await self.channel.close()


class KvEventsEnded(Exception):
    """A SubscribeKvEvents stream ended. `unimplemented`: the engine has no such RPC (an older build);
    `lagged`: the engine dropped this subscriber for reading too slowly (subscribing again at once is right)."""

    def __init__(self, code: str):
        super().__init__(f"KV events ended with {code}")
        self.unimplemented = code == "UNIMPLEMENTED"
        self.lagged = code == "RESOURCE_EXHAUSTED"


def is_retryable_elsewhere(exc: BaseException) -> bool:
    """An engine call that failed this way before any message may be tried on another replica: the replica is
    full (RESOURCE_EXHAUSTED) or gone or draining (UNAVAILABLE); it ran nothing the client could have seen."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                     grpc.StatusCode.UNAVAILABLE)


class EngineStream:
    """One engine request's messages, buffered so that a slow client never holds up the engine stream: fed by the
    worker's shared BatchCall (services.tokenizer.serving.engine_batch), or read from a Generate call by its own task.

    take() returns every token id that arrived since the previous take(), with the newest engine message (its
    usage and finish reason are the current ones), so a client that reads slower than the engine streams gets
    one message per write it can take instead of one per engine step.
    """

    def __init__(self, call=None, on_cancel=None):
        """Reads `call` (a Generate call) in its own task; without one, a BatchCall feeds it, and `on_cancel`
        tells that call the stream was given up."""
        self._call = call
        self._on_cancel = on_cancel
        # per completion index (sampling.n): ids, PositionLogprobs (one per id, when asked for) and newest message
        self._ids: dict[int, list[int]] = {}
        self._logprobs: dict[int, list] = {}
        self._last: dict[int, engine_pb2.GenerateResponse] = {}
        self._prompt_logprobs: list = []  # PositionLogprobs of the prompt, on completion 0's first message
        self._taken_index = -1  # the index of the last take(), -1 before the first
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._task = asyncio.create_task(self._read()) if call is not None else None

    async def _read(self) -> None:
        error = None
        try:
            async for response in self._call:
                self.feed(response)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (handed to take(), which raises it in the handler)
            error = exc
        finally:
            self.end(error)

    def feed(self, response: engine_pb2.GenerateResponse) -> None:
        """One engine message of this request."""
        index = response.index
        self._ids.setdefault(index, []).extend(response.token_ids)
        if response.logprobs:
            self._logprobs.setdefault(index, []).extend(response.logprobs)
        if response.prompt_logprobs:
            self._prompt_logprobs = list(response.prompt_logprobs)
        self._last[index] = response
        if self._waiter is not None:
            self._wake()

    def end(self, error: BaseException | None = None) -> None:
        """No more messages will come; `error`, if any, is raised by the take() that finds nothing left."""
        self._error = error
        self._ended = True
        self._wake()

    @property
    def has_messages(self) -> bool:
        """Whether any engine message arrived (a request that got none may still be sent elsewhere)."""
        return bool(self._last) or self._taken_index >= 0

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> tuple[list[int], engine_pb2.GenerateResponse | None]:
        """(ids since the last take, the newest engine message) of one completion (the lowest index with news:
        its `index` field says which); None once the call ended without new messages."""
        if not self._last and not self._ended:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        if not self._last:
            if self._error is not None:
                raise self._error
            return [], None
        index = min(self._last)
        self._taken_index = index
        return self._ids.pop(index, []), self._last.pop(index)

    def take_logprobs(self) -> list:
        """The PositionLogprobs of the ids the last take() returned (empty when the request asked for none)."""
        return self._logprobs.pop(self._taken_index, [])

    def take_prompt_logprobs(self) -> list:
        """The prompt's PositionLogprobs, once: with the take() that returned completion 0's first message (they
        arrive on it, and take() serves the lowest index first); empty on every other take."""
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, []
        return prompt_logprobs

    def cancel(self) -> None:
        """Cancel the engine call (the engine aborts the request) and stop reading."""
        if self._call is not None:
            self._call.cancel()
            self._task.cancel()
        if self._on_cancel is not None:
            on_cancel, self._on_cancel = self._on_cancel, None
            on_cancel()

    def follow(self, call) -> None:
        """Read `call` from now on (a Generate call that replaces a BatchCall the engine does not have)."""
        self._call, self._on_cancel = call, None
        self._task = asyncio.create_task(self._read())


def upstream_error(exc: grpc.aio.AioRpcError) -> Exception:
    """Map an engine call's failure to the typed error our interceptor turns into the client's status."""
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return UnavailableError(f"engine unavailable: {exc.details()}")
    status = rpc_status.from_call(exc)
    if status is None:
        from google.rpc import status_pb2

        status = status_pb2.Status(code=exc.code().value[0], message=exc.details() or "")
    return UpstreamStatusError(status)


async def watch_engine(client: EngineClient, on_change, interval_s: float = 1.0) -> None:
    """Follow the engine's readiness forever; call on_change(ready) whenever it flips.

    While the engine answers, its health Watch stream tells each flip as it happens (EngineClient.follow_serving);
    while it does not, or when it has no Watch (an older build), GetEngineInfo is polled every interval_s.
    """
    previous = None

    async def report(ready: bool) -> None:
        nonlocal previous
        if ready != previous:
            previous = ready
            await on_change(ready)

    has_watch = True
    while True:
        ready = await client.check()
        await report(ready)
        if ready and has_watch:
            ended = await client.follow_serving(report)
            has_watch = ended != grpc.StatusCode.UNIMPLEMENTED.name
            if has_watch:  # the stream broke: the engine went away (or restarted), which a check tells at once
                await report(await client.check())
        await asyncio.sleep(interval_s)

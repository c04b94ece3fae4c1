"""gRPC server plumbing shared by both services: error mapping, health, reflection, keepalive, shutdown."""

import asyncio
import contextlib
import contextvars
import inspect
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from services.common.errors import (
    InvalidRequestError,
    QueueFullError,
    UnavailableError,
    UpstreamStatusError,
)
from services.common import logs
from services.common.reuseport import WorkerGroup
from services.common.validation import escape_for_log

logger = logging.getLogger(__name__)
WORKER_EXIT_MARGIN_S = 10.0
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

MAX_PENDING_CALLS = 10_000
UNREQUESTED_CALL_MAX_S = 3600
# Long generation streams: allow client pings without data and never punish them (ARCHITECTURE.md §4).
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # Calls that arrived but that the server has not yet taken up: grpc.aio takes one per event-loop turn, so
    # a burst waits here. grpc's defaults refuse some past 1,000 of them and all past 3,000, and cancel one that
    # waited 30 s, each time as CANCELLED with no reason, which a client cannot act on. A burst up to
    # MAX_PENDING_CALLS waits its turn (each call's own deadline still applies); admission is the engine's.
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_MAX_S),
]
CLIENT_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


def configure_logging(level: str = "INFO", log_format: str = "text") -> None:
    """Every log line of this process as `log_format` (text or json), with the current request id, escaped
    (services.common.logs)."""
    logs.configure(level, log_format, request_id_var.get)


def status_code_name(exc: BaseException, context: grpc.aio.ServicerContext | None = None) -> str:
    """The name of the gRPC status a handler's exception ends its call with (for metrics and request logs)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining() if context is not None else None
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code() if context is not None else None
        return code.name if code is not None else "UNKNOWN"
    return code_pb2.Code.Name(status_for(exc).code)


def status_for(exc: BaseException) -> status_pb2.Status:
    """The google.rpc.Status a typed error maps to; unknown errors become a bare INTERNAL."""
    if isinstance(exc, UpstreamStatusError):
        return exc.status
    if isinstance(exc, MalformedStreamError):
        return exc.request.status()
    if isinstance(exc, InvalidRequestError):
        violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.description)
        return _status(code_pb2.INVALID_ARGUMENT, str(exc), error_details_pb2.BadRequest(field_violations=[violation]))
    if isinstance(exc, QueueFullError):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(exc.retry_after_s * 1e9))  # NOTE: Duration(nanos=...) must stay below 1 s
        retry = error_details_pb2.RetryInfo(retry_delay=delay)
        return _status(code_pb2.RESOURCE_EXHAUSTED, str(exc), retry)
    if isinstance(exc, UnavailableError):
        return _status(code_pb2.UNAVAILABLE, str(exc))
    return _status(code_pb2.INTERNAL, f"internal error (request {request_id_var.get()})")


def _status(code: int, message: str, *details) -> status_pb2.Status:
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    return status_pb2.Status(code=code, message=message, details=packed)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    status = status_for(exc)
    if status.code == code_pb2.INTERNAL:
        logger.error("unhandled error", exc_info=exc)
    else:
        logger.info("request rejected: %s", escape_for_log(str(exc)))  # NOTE: may quote the client's strings
    await context.abort_with_status(rpc_status.to_status(status))


class MalformedRequest:
    """What a method receives when its request bytes do not parse (corrupt body, invalid UTF-8 in a string field)."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: Exception):
        self.type_name = type_name
        self.error = error

    def status(self) -> status_pb2.Status:
        """INVALID_ARGUMENT with a BadRequest on the whole message (field ""): protobuf does not say which field."""
        description = f"not a valid {self.type_name}: {self.error}"
        violation = error_details_pb2.BadRequest.FieldViolation(field="", description=description)
        return _status(code_pb2.INVALID_ARGUMENT, f"malformed request: {description}",
                       error_details_pb2.BadRequest(field_violations=[violation]))


class MalformedStreamError(Exception):
    """A message of a client stream did not parse: the call ends with that message's INVALID_ARGUMENT."""

    def __init__(self, request: MalformedRequest):
        super().__init__(request.error)
        self.request = request


def _tolerant(deserializer):
    """A request deserializer that returns MalformedRequest instead of raising (grpc would answer UNKNOWN with the
    exception's class name), so the method wrapper can answer INVALID_ARGUMENT."""
    if deserializer is None:
        return None
    type_name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "request"

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or a UnicodeDecodeError
            return MalformedRequest(type_name, exc)

    return deserialize


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """The one place where typed errors become gRPC statuses; clients never see a stack trace.

    Also: a request that does not parse gets INVALID_ARGUMENT, and with a ServingState, every call but the
    health service's counts as in flight (a drain waits for them; see run_until_signalled).
    """

    def __init__(self, state: "ServingState | None" = None):
        self.state = state

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        tracked = self.state if not handler_call_details.method.startswith(_HEALTH_PREFIX) else None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, tracked),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, tracked),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                # the same wrapping in either convention: a MalformedRequest reaches the behavior inside the
                # request iterator, and GenerateBatch raises MalformedStreamError for it
                _wrap_stream(handler.stream_stream, tracked),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler


_HEALTH_PREFIX = f"/{health_pb2.DESCRIPTOR.services_by_name['Health'].full_name}/"


def _wrap_unary(behavior, state: "ServingState | None"):
    async def wrapped(request, context):
        if isinstance(request, MalformedRequest):
            await context.abort_with_status(rpc_status.to_status(request.status()))
        with _in_flight(state):
            try:
                return await behavior(request, context)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:
                await abort_with(context, exc)

    return wrapped


def _wrap_stream(behavior, state: "ServingState | None"):
    if inspect.iscoroutinefunction(behavior):
        # The reader/writer form (responses sent with `await context.write(...)`), e.g. Health/Watch: wrapped as a
        # coroutine, since grpc.aio picks the calling convention from the handler's type.
        return _wrap_unary(behavior, state)

    async def wrapped(request, context):
        if isinstance(request, MalformedRequest):
            await context.abort_with_status(rpc_status.to_status(request.status()))
        with _in_flight(state):
            try:
                async for response in behavior(request, context):
                    yield response
            except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:
                await abort_with(context, exc)

    return wrapped


@contextlib.contextmanager
def _in_flight(state: "ServingState | None"):
    if state is None:
        yield
        return
    state.num_in_flight += 1
    try:
        yield
    finally:
        state.num_in_flight -= 1
        if not state.num_in_flight:
            state.idle.set()


class ServingState:
    """grpc.health.v1 for one service: "" alive at once, the full name SERVING only when ready."""

    def __init__(self, service_name: str):
        self.service_name = service_name
        self.drain_started = asyncio.Event()  # set with `draining`: for streams that never end alone
        self.health = health.aio.HealthServicer()
        self.draining = False
        self._ready = False
        self.num_in_flight = 0  # calls other than health checks, counted by ErrorMappingInterceptor
        self.idle = asyncio.Event()  # set whenever num_in_flight drops to 0

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is in flight; False if some still are after timeout_s."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.num_in_flight:
            self.idle.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.idle.wait(), remaining)
        return True

    async def set(self, name: str, status: int) -> None:
        await self.health.set(name, status)

    async def mark_alive(self) -> None:
        await self.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.set(self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def mark_ready(self, ready: bool = True) -> None:
        """Set this process's health; each process of a shared port logs its own flips (with its pid)."""
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        if ready != self._ready:
            self._ready = ready
            logger.info("process %d %s", os.getpid(), "serving" if ready else "not serving")
        await self.set(self.service_name, status)

    async def mark_draining(self) -> None:
        self.draining = True
        self.drain_started.set()
        await self.health.enter_graceful_shutdown()


def build_server(service_names: Iterable[str], state: ServingState,
                 add_servicers: Callable[[grpc.aio.Server], None], reuse_port: bool = False,
                 max_receive_bytes: int | None = None) -> grpc.aio.Server:
    """A grpc.aio server with error mapping, health, reflection and keepalive settings.

    reuse_port: bind with SO_REUSEPORT, for several processes on one port (services.common.reuseport).
    max_receive_bytes: the largest request message accepted (default 64 MiB); larger ones get RESOURCE_EXHAUSTED.
    """
    options = [*SERVER_OPTIONS, ("grpc.so_reuseport", 1 if reuse_port else 0)]
    if max_receive_bytes is not None:
        options = [(key, max_receive_bytes if key == "grpc.max_receive_message_length" else value)
                   for key, value in options]
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(state)], options=options)
    add_servicers(server)
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    names = list(service_names) + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                   reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return server


async def run_until_signalled(server: grpc.aio.Server, state: ServingState, grace_s: float,
                              on_stop: Callable[[], Awaitable[None]] | None = None,
                              workers: WorkerGroup | None = None, handle_sigint: bool = True) -> None:
    """Serve until SIGINT/SIGTERM, then drain: report NOT_SERVING, let streams finish for grace_s and stop.

    While draining the server keeps listening and answering: health checks (new and existing connections) get
    NOT_SERVING, new Generate calls UNAVAILABLE (the servicers check `state.draining`), until no call is in
    flight (ServingState.wait_idle) or grace_s has passed; only then does the server stop, cancelling what is
    left. So a readiness probe sees NOT_SERVING rather than "connection refused", and the process exits as soon
    as its last stream ends.

    With `workers` (the other processes on this port), a signal is passed on to them as SIGTERM, and a worker
    that exits on its own stops this process too (workers.exit_code is then 1); the workers are joined last.
    handle_sigint=False in a worker process: its parent turns Ctrl-C into one SIGTERM per worker.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM) if handle_sigint else (signal.SIGTERM,):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.create_task(stop.wait())]
    if workers is not None:
        waiters.append(asyncio.create_task(workers.wait_exit()))
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    if workers is not None:
        workers.stop()
    logger.info("draining: health NOT_SERVING, %d calls in flight, grace %.1fs", state.num_in_flight, grace_s)
    await state.mark_draining()
    if not await state.wait_idle(grace_s):
        logger.warning("grace period over: cancelling %d calls in flight", state.num_in_flight)
    await server.stop(0)
    if on_stop is not None:
        await on_stop()
    if workers is not None:
        await asyncio.to_thread(workers.join, grace_s + WORKER_EXIT_MARGIN_S)


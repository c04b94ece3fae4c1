"""One GenerateBatch call per engine replica, shared by every request this tokenizer process sends there.

Per engine step the replica sends one message for all of this process's requests, instead of one message per
request per step: the relay's cost per token falls to a dict look-up and a list extend. Each request still
reads its own EngineStream, and fails exactly as its own Generate call would: an errors entry becomes the
AioRpcError that call would have raised (status details included), so routing and error mapping stay one
code path for both kinds of call.
"""

import asyncio
import logging
from dataclasses import dataclass

import grpc
from llmserve.engine.v1 import engine_pb2

from services.common.errors import DuplicateRequestError
from services.common.grpc_server import status_for
from services.tokenizer.serving.engine_client import EngineStream

logger = logging.getLogger(__name__)
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# The most bytes of requests one GenerateBatchRequest carries, unless it carries a single request: the engine
# accepts messages up to 5 x max_model_len + 64 KiB (services/engine/serving/main.py), so a message within this
# size, or holding one valid request, always fits. A burst of requests becomes several messages.
MESSAGE_BUDGET_BYTES = 60 * 1024
_FRAMING_BYTES = 4  # a repeated field's tag and length, for entries under 2 MiB
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


def rpc_error(status) -> grpc.aio.AioRpcError:
    """The AioRpcError a call ending with `status` (a google.rpc.Status or RequestStatus) raises."""
    trailing = grpc.aio.Metadata((_STATUS_DETAILS_KEY, status.SerializeToString()))
    return grpc.aio.AioRpcError(_STATUS_CODES.get(status.code, grpc.StatusCode.UNKNOWN), grpc.aio.Metadata(),
                                trailing, status.message)


def _unavailable(message: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


@dataclass(slots=True, eq=False)
class _Entry:
    """A request on the call: its stream, the completions the engine has yet to finish, whether it is over."""

    request: engine_pb2.GenerateRequest
    stream: EngineStream | None = None
    remaining: int = 1
    over: bool = False


class BatchCall:
    """Opens the GenerateBatch call on first use, and again after it ends (the engine restarted or drained).

    `unsupported` turns true when the engine answers UNIMPLEMENTED (an older build): the requests that were on
    the call go on as Generate calls, and the caller opens per-request calls from then on.
    """

    def __init__(self, stub, target: str):
        self._stub = stub
        self.target = target
        self.unsupported = False
        self._call = None
        self._tasks: list[asyncio.Task] = []
        self._entries: dict[str, _Entry] = {}
        self._pending = engine_pb2.GenerateBatchRequest()
        self._pending_cancels: set[str] = set()
        self._pending_bytes = 0  # of the requests in _pending
        self._queue: list[engine_pb2.GenerateBatchRequest] = []
        self._news = asyncio.Event()

    def open(self, request: engine_pb2.GenerateRequest) -> EngineStream:
        """Send a request on the call; its stream fails as a Generate call would (e.g. a duplicate id)."""
        request_id = request.request_id
        if request_id in self._entries:  # its messages could not be told apart from the live one's
            stream = EngineStream()
            stream.end(rpc_error(status_for(DuplicateRequestError(f"request_id {request_id!r} is already in flight"))))
            return stream
        if self._call is None:
            self._connect()
        size = request.ByteSize() + _FRAMING_BYTES
        if request_id in self._pending_cancels:  # the cancel of an earlier request of that id must go first
            self._start_message()
        self._reserve(size)
        entry = _Entry(request, remaining=request.sampling.n if request.sampling.HasField("n") else 1)
        entry.stream = EngineStream(on_cancel=lambda: self._cancel(entry))
        self._entries[request_id] = entry
        self._pending.requests.append(request)
        self._news.set()
        return entry.stream

    def close(self) -> None:
        """Cancel the call (the engine aborts its requests); the streams still open end UNAVAILABLE."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        for task in self._tasks:
            task.cancel()
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            entry.over = True
            entry.stream.end(_unavailable(f"the client of engine {self.target} was closed"))

    def _cancel(self, entry: _Entry) -> None:
        if entry.over:
            return
        entry.over = True
        request_id = entry.request.request_id
        del self._entries[request_id]
        if self._call is not None:
            self._reserve(len(request_id) + _FRAMING_BYTES)
            self._pending.cancel_request_ids.append(request_id)
            self._pending_cancels.add(request_id)
            self._news.set()

    def _reserve(self, size: int) -> None:
        """Make room for `size` more bytes in the pending message, starting a new one past the budget."""
        if self._pending_bytes and self._pending_bytes + size > MESSAGE_BUDGET_BYTES:
            self._start_message()
        self._pending_bytes += size

    def _start_message(self) -> None:
        self._queue.append(self._pending)
        self._new_pending()

    def _new_pending(self) -> None:
        self._pending, self._pending_cancels, self._pending_bytes = engine_pb2.GenerateBatchRequest(), set(), 0

    def _connect(self) -> None:
        call = self._call = self._stub.GenerateBatch()
        self._tasks = [asyncio.create_task(self._write(call)), asyncio.create_task(self._read(call))]

    async def _write(self, call) -> None:
        """Send what accumulated since the last write, one message (more where order or size demands).

        Nothing is written before the engine's initial metadata: an engine without GenerateBatch ends the call
        UNIMPLEMENTED at once, and a write racing that answer would turn the call's status into INTERNAL.
        """
        try:
            await call.initial_metadata()
            if call.done():
                return
            while True:
                await self._news.wait()
                self._news.clear()
                if self._pending.requests or self._pending.cancel_request_ids:
                    self._start_message()
                messages, self._queue = self._queue, []
                for message in messages:
                    await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call ended: the reader fails its requests

    async def _read(self, call) -> None:
        error = None
        try:
            async for message in call:
                self._dispatch(message)
            error = _unavailable(f"engine {self.target} ended the batch call")
        except grpc.aio.AioRpcError as exc:
            error = exc
        finally:
            self._lose(call, error)

    def _dispatch(self, message: engine_pb2.GenerateBatchResponse) -> None:
        entries = self._entries
        for response in message.responses:
            entry = entries.get(response.request_id)
            if entry is None:
                continue
            entry.stream.feed(response)
            if response.finish_reason:
                entry.remaining -= 1
                if not entry.remaining:  # the engine is done with it: nothing to cancel
                    entry.over = True
                    del entries[response.request_id]
        for failed in message.errors:
            entry = entries.pop(failed.request_id, None)
            if entry is not None:
                entry.over = True
                entry.stream.end(rpc_error(failed.status))

    def _lose(self, call, error: grpc.aio.AioRpcError | None) -> None:
        """The call ended: fail its requests with its status (or re-send them as Generate calls, see class)."""
        if self._call is not call:  # closed by close(): its requests are the caller's to end
            return
        self._call = None
        self._tasks[0].cancel()
        self._new_pending()
        self._queue = []
        entries, self._entries = self._entries, {}
        if error is not None and error.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.unsupported = True
            logger.info("engine %s has no GenerateBatch; using a Generate call per request", self.target)
        for entry in entries.values():
            entry.over = True
            if self.unsupported and not entry.stream.has_messages:
                entry.stream.follow(self._stub.Generate(entry.request))
            else:
                entry.stream.end(error)

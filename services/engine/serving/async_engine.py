"""A front's view of the engine-core process: asyncio streams over one connection, coalesced per reader.

Commands go out through a writer thread (a send may block while the core is mid-step; the event loop
never does). Outputs come in on the event loop itself (`add_reader` on the connection): each step's
message is one wake-up that appends every token to its stream's pending list and wakes that stream's
reader if it sleeps. A reader takes everything pending at once, so a client that reads slower than the
engine steps gets several tokens per message instead of falling further behind. KV-cache event subscribers
(`kv_events`) are fed the same way, by services.engine.serving.kv_subscribers. No torch or grpc here.
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Protocol

from services.common.errors import DuplicateRequestError, UnavailableError
from services.engine.core.interfaces import EngineStats, RequestOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import FinishReason
from services.engine.serving.kv_subscribers import KvEventBatch, KvSubscribers
from services.engine.serving.messages import (
    NO_TOKEN, AbortAnswer, AbortQuery, AbortRequests, AddRejected, AddRequest, EngineReady, KvEventsSnapshot,
    KvEventsSubscribe, KvEventsUnsubscribe, StepOutputs, decode, encode)

logger = logging.getLogger(__name__)
_STOP_WRITER = object()
MIN_KV_PENDING = 4096  # a KV-event subscriber may fall this many changes behind, or the cache's size if larger


class _Stream:
    """One request's outputs not yet taken by its reader."""

    __slots__ = ("request_id", "num_prompt_tokens", "pending", "pending_logprobs", "num_cached_tokens",
                 "num_completion_tokens", "finished", "error", "waiter", "index", "prompt_logprobs", "sink")

    def __init__(self, request_id: str, num_prompt_tokens: int, index: int = 0, sink=None):
        self.request_id = request_id
        self.sink = sink  # a reader of many streams (StreamSink) instead of a waiter per stream
        self.index = index  # which of the request's sampling.n completions
        self.num_prompt_tokens = num_prompt_tokens
        self.pending: list[int] = []
        self.pending_logprobs: list = []  # TokenLogprobs, one per pending id, when the request asked for them
        self.num_cached_tokens = 0
        self.num_completion_tokens = 0
        self.finished = None  # FinishedRequest once the core says so
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.prompt_logprobs = None  # PromptLogprobs, until the reader takes them with the first token

    def has_output(self, interval: int) -> bool:
        """Whether the reader should write now: the first token, `interval` pending tokens, the end or an error."""
        if self.finished is not None or self.error is not None:
            return True
        return len(self.pending) >= interval or (self.num_completion_tokens == 0 and bool(self.pending))

    def wake(self) -> None:
        if self.sink is not None:
            self.sink.on_output(self)
            return
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self) -> RequestOutput:
        ids, self.pending = self.pending, []
        logprobs = None
        if self.pending_logprobs:
            logprobs, self.pending_logprobs = self.pending_logprobs, []
        self.num_completion_tokens += len(ids)
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        finished = self.finished
        if finished is None:  # every step of every request: positional, as keywords cost more per call
            return RequestOutput(self.request_id, ids, None, self.num_prompt_tokens, self.num_completion_tokens,
                                 self.num_cached_tokens, None, None, logprobs, self.index, False, prompt_logprobs)
        return RequestOutput(self.request_id, ids, FinishReason(finished.finish_reason), finished.num_prompt_tokens,
                             finished.num_completion_tokens, finished.num_cached_tokens,
                             finished.matched_stop_token_id, queue_time_s=finished.queue_time_s, logprobs=logprobs,
                             index=self.index, prompt_logprobs=prompt_logprobs)


class StreamSink(Protocol):
    """Reads many requests' streams at once (a GenerateBatch call): told of each stream that has output."""

    def on_output(self, stream: "_Stream") -> None: ...


class AsyncEngine:
    """Streams RequestOutputs of the engine-core process to asyncio callers; `abort` is idempotent.

    `stream_interval` N > 1 wakes a stream's reader only once N tokens are pending (the first token and the
    finish at once): N times fewer messages on both hops for burstier inter-token times (SGLang's and
    vLLM's --stream-interval).

    `on_core_lost` is called once (on the event loop) if the core's connection closes while this front
    still wants it: every open stream has already failed with UnavailableError by then.
    """

    def __init__(self, connection, description, on_core_lost=None, stream_interval: int = 1):
        self._connection = connection
        self.description = description
        self._stream_interval = stream_interval
        self._on_core_lost = on_core_lost
        self._streams: dict[int, _Stream] = {}
        self._handles: dict[str, int] = {}
        self._next_handle = itertools.count()
        self._queries: dict[int, asyncio.Future] = {}
        self._next_query = itertools.count()
        self._stats = EngineStats(0, 0, 0, description.num_total_blocks, description.num_total_blocks, 0, 0, 0, 0)
        self._num_finished_in_core = 0
        self._aborting: set[int] = set()  # handles whose abort this front sent and the core has not yet reported
        self._kv_subscribers = KvSubscribers(max(description.num_total_blocks, MIN_KV_PENDING))
        self._next_subscriber = itertools.count()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_commands, name="engine-core-writer", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self.core_lost = False

    @classmethod
    def connect(cls, connection, on_core_lost=None, timeout_s: float | None = None,
                stream_interval: int = 1) -> "AsyncEngine":
        """Wait (blocking) for the core's EngineReady on this connection; raise its start-up error, if any."""
        if timeout_s is not None and not connection.poll(timeout_s):
            raise RuntimeError("the engine core did not start in time")
        try:
            ready = decode(connection.recv_bytes())
        except EOFError:
            raise RuntimeError("the engine core process died while starting") from None
        assert isinstance(ready, EngineReady)
        if isinstance(ready.description, BaseException):
            raise ready.description
        return cls(connection, ready.description, on_core_lost, stream_interval)

    def start(self) -> None:
        """Start relaying; call on the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._connection.fileno(), self._on_readable)
        self._writer.start()

    def shutdown(self) -> None:
        """Stop relaying and hang up: the core aborts whatever this front still had in flight."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._connection.fileno())
        self._commands.put(_STOP_WRITER)
        if self._writer.is_alive():
            self._writer.join(5.0)
        self._connection.close()

    def stats(self) -> EngineStats:
        """The engine's figures as of the last step this front heard of."""
        return self._stats

    @property
    def num_finished_requests(self) -> int:
        """Requests finished, whatever the reason: the core's count, plus this front's aborts still on their way
        (a cancelled call is over for its caller as soon as its stream closes)."""
        return self._num_finished_in_core + len(self._aborting)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs, each with every token produced since the previous one.

        Errors the core raises on admission (full queue, duplicate id) come before anything is yielded;
        validate beforehand for field errors. Leaving the iteration early (cancel, deadline, disconnect)
        aborts the request, which frees its KV blocks before the core's next step.
        """
        streams = self.open(request_id, prompt_token_ids, sampling)
        unfinished = list(streams)
        try:
            while unfinished:
                ready = [stream for stream in unfinished if stream.has_output(self._stream_interval)]
                if not ready:
                    waiter = self._loop.create_future()  # any completion's output wakes the reader
                    for stream in unfinished:
                        stream.waiter = waiter
                    await waiter
                    continue
                for stream in ready:
                    if stream.error is not None:
                        unfinished.clear()
                        raise stream.error
                    output = stream.take()
                    if output.finish_reason is not None:
                        unfinished.remove(stream)
                        output.request_finished = not unfinished
                    yield output
        finally:
            self.close(streams, bool(unfinished))

    def open(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
             sink: "StreamSink | None" = None) -> list[_Stream]:
        """Submit a request; its streams, one per completion (sampling.n), for a reader to take() from.

        With a sink, the streams report output to sink.on_output instead of waking a waiter of their own.
        Every open() is followed by one close().
        """
        if self._stopped or self.core_lost:
            raise UnavailableError("engine is not available")
        if request_id in self._handles:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        handle = next(self._next_handle)  # completion i is handle + i: n consecutive handles
        streams = [_Stream(request_id, len(prompt_token_ids), 0, sink)]
        streams += [_Stream(request_id, len(prompt_token_ids), next(self._next_handle) - handle, sink)
                    for _ in range(sampling.n - 1)]
        for index, stream in enumerate(streams):
            self._streams[handle + index] = stream
        self._handles[request_id] = handle
        self._commands.put(AddRequest(handle, request_id, prompt_token_ids, sampling, time.monotonic()))
        return streams

    def close(self, streams: list[_Stream], unfinished: bool) -> None:
        """Forget an open()ed request; `unfinished` (the reader stopped before its last completion's finish)
        aborts it, which frees its KV blocks before the core's next step."""
        request_id = streams[0].request_id
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return
        for index in range(len(streams)):
            self._streams.pop(handle + index, None)
        if unfinished and not self.core_lost:
            self._commands.put(AbortRequests([request_id]))
            if not any(stream.finished is not None and stream.finished.request_finished for stream in streams):
                self._aborting.add(handle)  # else the core has counted it already

    def is_live(self, request_id: str) -> bool:
        """Whether this front has a stream open for the request."""
        return request_id in self._handles

    async def abort_any(self, request_ids: list[str], completions: list[tuple[str, int]] = ()
                        ) -> tuple[list[str], list[tuple[str, int]]]:
        """Abort these ids, then these (request id, index) completions, on whichever front they run; return the
        ids and the completions that were live."""
        if self.core_lost:
            raise UnavailableError("engine is not available")
        query_id = next(self._next_query)
        answer = self._queries[query_id] = self._loop.create_future()
        self._commands.put(AbortQuery(query_id, list(request_ids), list(completions)))
        try:
            return await answer
        finally:
            self._queries.pop(query_id, None)

    async def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """Yield the prefix cache's contents (a snapshot, first), then its changes, each batch all that is pending.

        Ends with UnavailableError when the core dies or end_kv_events is called, with SubscriberLagError
        (RESOURCE_EXHAUSTED) when this reader falls too far behind (services.engine.serving.kv_subscribers).
        """
        if self._stopped or self.core_lost:
            raise UnavailableError("engine is not available")
        subscriber_id = next(self._next_subscriber)
        subscriber = self._kv_subscribers.add(subscriber_id)
        self._commands.put(KvEventsSubscribe(subscriber_id))
        try:
            while True:
                yield await self._kv_subscribers.next_batch(subscriber, self._loop)
        finally:
            self._kv_subscribers.remove(subscriber_id)
            if not self.core_lost:
                self._commands.put(KvEventsUnsubscribe(subscriber_id))

    def end_kv_events(self, error: BaseException) -> None:
        """End every KV-event subscription of this front with `error` (on drain: they would never end alone)."""
        self._kv_subscribers.fail_all(error)

    # ---- the core's messages, on the event loop ----

    def _on_readable(self) -> None:
        try:
            while self._connection.poll():
                self._dispatch(decode(self._connection.recv_bytes()))
        except (EOFError, OSError):
            self._lose_core()

    def _dispatch(self, message) -> None:
        if isinstance(message, StepOutputs):
            self._deliver_step(message)
        elif isinstance(message, AddRejected):
            stream = self._streams.get(message.handle)
            if stream is not None:
                stream.error = message.error
                stream.wake()
        elif isinstance(message, AbortAnswer):
            answer = self._queries.get(message.query_id)
            if answer is not None and not answer.done():
                answer.set_result((message.aborted_request_ids, message.aborted_completions))
        elif isinstance(message, KvEventsSnapshot):
            self._kv_subscribers.on_snapshot(message)

    def _deliver_step(self, message: StepOutputs) -> None:
        self._stats = message.stats
        self._num_finished_in_core = message.num_finished_requests
        if self._kv_subscribers:
            self._kv_subscribers.on_step(message)
        streams, interval = self._streams, self._stream_interval
        logprobs = message.logprobs.unpack() if message.logprobs is not None else None
        for handle, prompt_logprobs in (message.prompt_logprobs or {}).items():
            stream = streams.get(handle)
            if stream is not None:
                stream.prompt_logprobs = prompt_logprobs  # rides with the first token, delivered below
        for position, (handle, token_id, num_cached) in enumerate(
                zip(message.handles, message.token_ids, message.num_cached_tokens)):
            stream = streams.get(handle)
            if stream is None:
                continue
            if token_id != NO_TOKEN:
                stream.pending.append(token_id)
                if logprobs is not None and position in logprobs:
                    stream.pending_logprobs.append(logprobs[position])
            stream.num_cached_tokens = num_cached
            if stream.has_output(interval):
                stream.wake()
        for finished in message.finished:
            if finished.request_finished:
                self._aborting.discard(finished.request_handle)
            stream = streams.get(finished.handle)
            if stream is not None:
                stream.finished = finished
                stream.wake()

    def _lose_core(self) -> None:
        if self.core_lost or self._stopped:
            return
        self.core_lost = True
        self._loop.remove_reader(self._connection.fileno())
        logger.error("the engine core process is gone; failing %d streams", len(self._streams))
        error = UnavailableError("the engine core process died")
        for stream in self._streams.values():
            stream.error = error
            stream.wake()
        for answer in self._queries.values():
            if not answer.done():
                answer.set_exception(error)
        self._kv_subscribers.fail_all(error)
        if self._on_core_lost is not None:
            self._on_core_lost()

    # ---- writer thread ----

    def _write_commands(self) -> None:
        while True:
            commands = [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            stop = any(command is _STOP_WRITER for command in commands)  # `in` would call each command's __eq__
            commands = [command for command in commands if command is not _STOP_WRITER]
            if commands:
                try:
                    self._connection.send_bytes(encode(commands))
                except OSError:
                    return  # the reader side notices the closed connection and fails the streams
            if stop:
                return

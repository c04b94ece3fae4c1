"""Runs the engine core on a dedicated thread and bridges it to asyncio callers.

The model step never runs on the event loop: the engine thread owns the EngineCore, takes add/abort
commands from a thread-safe queue between steps, and hands each step's outputs to the per-request
asyncio queues with `loop.call_soon_threadsafe`. No torch or grpc here.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.errors import DuplicateRequestError, QueueFullError, UnavailableError
from services.engine.core.engine import EngineCore
from services.engine.core.interfaces import EngineStats, RequestOutput
from services.engine.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


_STOP = object()
HANDOFF_WAIT_S = 0.05


def _put_all(loop: asyncio.AbstractEventLoop, items: list, relayed: threading.Event) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)
    loop.call_soon(relayed.set)  # after the consumers just woken have run


class AsyncEngine:
    """Thread-backed engine: `generate` streams RequestOutputs; `abort` is idempotent."""

    def __init__(self, core: EngineCore, max_waiting: int = 0):
        self._core = core
        self._max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._num_queued_adds = 0
        self._stats = core.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopped = True
        self._commands.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def core(self) -> EngineCore:
        return self._core

    def stats(self) -> EngineStats:
        """The figures as of the end of the last step (a snapshot; safe from any thread)."""
        return self._stats

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs step by step, the last one carrying the finish reason.

        Validation errors are raised before anything is yielded. Leaving the iteration early (cancel,
        deadline, disconnect) aborts the request, which frees its KV blocks before the next step.
        """
        if self._stopped:
            raise UnavailableError("engine is shutting down")
        self._core.validate_request(prompt_token_ids, sampling)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._register(request_id, stream)
        self._commands.put(_Add(request_id, list(prompt_token_ids), sampling, time.monotonic()))
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def is_live(self, request_id: str) -> bool:
        """Whether a stream for this request is open."""
        with self._lock:
            return request_id in self._streams

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _register(self, request_id: str, stream: _Stream) -> None:
        with self._lock:
            if request_id in self._streams:
                raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
            num_waiting = self._stats.num_waiting + self._num_queued_adds
            if self._max_waiting and num_waiting >= self._max_waiting:
                raise QueueFullError(f"waiting queue is full ({self._max_waiting} requests)")
            self._streams[request_id] = stream
            self._num_queued_adds += 1

    # ---- engine thread ----

    def _run(self) -> None:
        while not self._stopped:
            has_work = self._core.has_unfinished_requests()
            if not self._apply_commands(block=not has_work):
                break
            if self._core.has_unfinished_requests():
                self._step()
            self._stats = self._core.stats()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds/aborts; wait for one when idle. False when asked to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._core.abort_request(command.request_id)
            return
        with self._lock:
            self._num_queued_adds -= 1
            live = command.request_id in self._streams
        if not live:
            return
        try:
            self._core.add_request(command.request_id, command.prompt_token_ids, command.sampling,
                                   command.arrival_time)
        except Exception as exc:
            self._deliver(command.request_id, exc)

    def _step(self) -> None:
        try:
            outputs = self._core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all(exc)
            return
        self._deliver_step(outputs)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their event loops in one wake-up each, then give the loop a moment.

        NOTE: on a small CPU the gRPC work of a step competes with the next step's matmul threads; letting
        the loop relay the step's messages first (bounded by HANDOFF_WAIT_S) costs less than the contention.
        """
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.outputs, output))
        for loop, items in batches.items():
            relayed = threading.Event()
            loop.call_soon_threadsafe(_put_all, loop, items, relayed)
            relayed.wait(HANDOFF_WAIT_S)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._core.abort_request(request_id)
            self._deliver(request_id, exc)

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

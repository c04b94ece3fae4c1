"""One GenerateBatch call: many requests read together, one outgoing message per batch of their outputs.

The call's requests are opened on the AsyncEngine with this session as their StreamSink: a step's outputs
put the streams that have something to send on one ready list and set one event, so a step costs one
wake-up of the call's writer however many of its requests it advanced (a Generate call per request costs a
wake-up, a task switch and a gRPC message each). No grpc or protobuf here: server.py converts.
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.convert import RequestClock
from services.common.metrics import RequestObserver, RequestRecord, RequestScope
from services.common.validation import loggable_request_id
from services.engine.core.interfaces import RequestOutput
from services.engine.core.sampling_params import SamplingParams
from services.engine.serving.async_engine import AsyncEngine

CANCELLED = "CANCELLED"  # the status name a request's log line and metrics get when its caller gave it up


@dataclass(slots=True)
class BatchRequest:
    """One request of the call: its completions' streams, the ones not yet finished, its clock and record."""

    request_id: str
    clock: RequestClock
    scope: RequestScope
    record: RequestRecord  # scope.record, read on every output
    streams: list = field(default_factory=list)
    unfinished: set[int] = field(default_factory=set)


@dataclass(slots=True)
class BatchOutputs:
    """What the call's writer sends next: (request, output) pairs in arrival order, and failed requests."""

    outputs: list[tuple[BatchRequest, RequestOutput]]
    errors: list[tuple[str, BaseException]]


class BatchSession:
    """The requests of one GenerateBatch call; a StreamSink of the AsyncEngine.

    `admit(request_id, prompt, sampling)` and `cancel(request_id)` come from the call's reader; `collect()`
    from its writer whenever `wakeup` is set. Every request ends exactly once: with its last output, with an
    error, or cancelled (by the caller, or by `close()` when the call ends).
    """

    def __init__(self, engine: AsyncEngine, observer: RequestObserver, code_of: Callable[[BaseException], str]):
        self.engine = engine
        self.observer = observer
        self.code_of = code_of
        self.requests: dict[str, BatchRequest] = {}
        self.wakeup = asyncio.Event()
        self._ready: dict[int, object] = {}  # id(stream) -> stream with output, in the order they reported
        self._errors: list[tuple[str, BaseException]] = []

    def on_output(self, stream) -> None:
        self._ready[id(stream)] = stream
        self.wakeup.set()

    def start(self, request_id: str) -> BatchRequest:
        """Begin a request's record (before validation, as a Generate call's begins with the call)."""
        clock = RequestClock()
        scope = self.observer.track(loggable_request_id(request_id), clock, self.code_of)
        scope.__enter__()
        return BatchRequest(request_id, clock, scope, scope.record)

    def admit(self, request: BatchRequest, prompt: list[int], sampling: SamplingParams) -> None:
        """Open a validated request on the engine; a refusal (duplicate id, engine gone) fails it at once."""
        record = request.record
        record.num_prompt_tokens, record.admitted = len(prompt), True
        try:
            request.streams = self.engine.open(request.request_id, prompt, sampling, sink=self)
        except Exception as exc:  # noqa: BLE001 (the request's error entry; the call goes on)
            self.fail(request, exc)
            return
        request.unfinished = set(range(len(request.streams)))
        self.requests[request.request_id] = request

    def fail(self, request: BatchRequest, exc: BaseException) -> None:
        """End a request that never opened (its validation failed) or whose stream failed, with its error."""
        self._errors.append((request.request_id, exc))
        self._end(request, exc)
        self.wakeup.set()

    def cancel(self, request_id: str) -> None:
        """The caller gave the request up (unknown or ended ids are ignored): abort it in the engine."""
        request = self.requests.get(request_id)
        if request is not None:
            self._end(request, asyncio.CancelledError())

    def close(self) -> None:
        """The call ended: abort every request still open on it."""
        for request in list(self.requests.values()):
            self._end(request, asyncio.CancelledError())

    def collect(self) -> BatchOutputs:
        """Take every output and error pending since the last collect()."""
        self.wakeup.clear()
        ready, self._ready = self._ready, {}
        errors, self._errors = self._errors, []
        outputs = []
        requests = self.requests
        for stream in ready.values():  # each reported has_output() and nothing took its output since
            request = requests.get(stream.request_id)
            if request is None or stream.index not in request.unfinished:
                continue
            if stream.error is not None:  # refused by the core, or the core is gone: nothing to abort
                request.unfinished.clear()
                errors.append((request.request_id, stream.error))
                self._end(request, stream.error)
                continue
            output = stream.take()
            self._observe(request, output)
            outputs.append((request, output))
        return BatchOutputs(outputs, errors)

    def _observe(self, request: BatchRequest, output: RequestOutput) -> None:
        record = request.record
        if output.new_token_ids:
            request.clock.mark_token()
        record.num_completion_tokens = output.num_completion_tokens
        if output.finish_reason is None:
            return
        request.unfinished.discard(output.index)
        output.request_finished = not request.unfinished
        if output.request_finished:
            record.finish(output.finish_reason, output.num_prompt_tokens, output.num_completion_tokens,
                          output.num_cached_tokens)
            record.queue_time_s = output.queue_time_s
            self._end(request, None)

    def _end(self, request: BatchRequest, exc: BaseException | None) -> None:
        if self.requests.get(request.request_id) is request:  # not a refused duplicate of a live one
            del self.requests[request.request_id]
            self.engine.close(request.streams, bool(request.unfinished))
        request.scope.__exit__(None if exc is None else type(exc), exc, None)

"""grpc.aio adapter of the engine service: protobuf in, core calls, protobuf out. No model code here."""

import asyncio
import contextlib
import logging
import os

import grpc
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc

from services.common.errors import EngineError, InvalidRequestError, UnavailableError
from services.common.grpc_server import (
    MalformedRequest, MalformedStreamError, ServingState, request_id_var, status_code_name)
from services.common.metrics import RequestObserver
from services.common.validation import check_request_id, loggable_request_id
from services.engine.serving.async_engine import AsyncEngine
from services.engine.serving.batch_session import CANCELLED, BatchSession
from services.engine.serving.convert import (
    RequestClock, batch_responses, completion_refs_from_proto, completion_refs_to_proto, kv_events_response, load_report,
    response_from_output, sampling_from_proto)
from services.engine.core.request_validator import RequestValidator
from services.engine.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Streams sampled token ids per engine step; cancellation aborts the sequence within one step."""

    _drain_watch: asyncio.Task | None = None  # ends KV-event subscriptions when the drain starts

    def __init__(self, engine: AsyncEngine, info: engine_pb2.GetEngineInfoResponse, state: ServingState,
                 validator: RequestValidator, metrics=None):
        """metrics: this front's EngineMetrics (services.engine.serving.metrics), or None when they are off."""
        self.engine = engine
        self.info = info
        self.state = state
        self.validator = validator
        self.requests = RequestObserver(logger, metrics)

    def register(self, server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self, server)

    async def warm_up(self) -> None:
        """One short request through the whole path before reporting ready."""
        sampling = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        async for _ in self.engine.generate(f"warm-up-{os.getpid()}", [self.info.eos_token_ids[0] if self.info.eos_token_ids else 0],
                                            sampling):
            pass

    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        clock = RequestClock()
        with self.requests.track(loggable_request_id(request.request_id), clock, lambda exc: status_code_name(exc, context)) as record:
            prompt, sampling = self._validated(request)
            record.num_prompt_tokens, record.admitted = len(prompt), True
            stream = self.engine.generate(request.request_id, prompt, sampling)
            async with contextlib.aclosing(stream):
                async for output in stream:
                    if output.new_token_ids:
                        clock.mark_token()
                    record.num_completion_tokens = output.num_completion_tokens  # a cancelled call logs its count
                    if output.request_finished:  # the last completion's (sampling.n): one record per request
                        record.finish(output.finish_reason, output.num_prompt_tokens, output.num_completion_tokens,
                                      output.num_cached_tokens)
                        record.queue_time_s = output.queue_time_s
                    yield response_from_output(output, clock)

    def _validated(self, request: engine_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """(prompt, sampling) of a request this engine may admit; raises the typed error naming the field."""
        if self.state.draining:
            raise UnavailableError("engine is draining")
        if not request.request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        check_request_id(request.request_id)
        request_id_var.set(request.request_id)
        prompt = list(request.prompt_token_ids)
        sampling = sampling_from_proto(request.sampling, len(prompt), self.info.max_model_len)
        self.validator.validate(prompt, sampling)
        return prompt, sampling

    async def GenerateBatch(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        """Many Generate calls on one stream: one message per batch of outputs (see the contract).

        A reader task admits and cancels requests as they arrive; this coroutine writes. Written with
        context.write, so the call is a coroutine (grpc.aio picks the calling convention by type).
        """
        await context.send_initial_metadata(())  # the contract: the caller may wait for it before writing
        session = BatchSession(self.engine, self.requests, _batch_code_of)
        reader = asyncio.ensure_future(self._read_batch(request_iterator, session))
        reader.add_done_callback(lambda _: session.wakeup.set())
        drain = asyncio.ensure_future(self.state.drain_started.wait())
        drain.add_done_callback(lambda _: session.wakeup.set())
        try:
            while True:
                await session.wakeup.wait()
                for message in batch_responses(session.collect()):
                    await context.write(message)
                if reader.done() and reader.exception() is not None:
                    raise reader.exception()
                if not session.requests and (reader.done() or self.state.draining):
                    return
        finally:
            reader.cancel()
            drain.cancel()
            session.close()

    async def _read_batch(self, request_iterator, session: BatchSession) -> None:
        async for message in request_iterator:
            if isinstance(message, MalformedRequest):
                raise MalformedStreamError(message)
            for request in message.requests:
                batch_request = session.start(request.request_id)
                try:
                    prompt, sampling = self._validated(request)
                except Exception as exc:  # noqa: BLE001 (the request's error entry; the call goes on)
                    if not isinstance(exc, EngineError):  # an INTERNAL answer: keep its trace, as abort_with does
                        logger.error("unhandled error", exc_info=exc)
                    session.fail(batch_request, exc)
                    continue
                session.admit(batch_request, prompt, sampling)
            for request_id in message.cancel_request_ids:
                session.cancel(request_id)

    async def Abort(self, request: engine_pb2.AbortRequest, context) -> engine_pb2.AbortResponse:
        aborted, completions = await self.engine.abort_any(list(request.request_ids),
                                                           completion_refs_from_proto(request.completions))
        return engine_pb2.AbortResponse(aborted_request_ids=aborted,
                                        aborted_completions=completion_refs_to_proto(completions))

    async def GetEngineInfo(self, request, context) -> engine_pb2.GetEngineInfoResponse:
        return self.info

    async def GetLoad(self, request, context) -> engine_pb2.LoadReport:
        return load_report(self.engine.stats(), self.engine.num_finished_requests, self.state.draining)

    async def SubscribeKvEvents(self, request, context):
        """A snapshot of this engine's prefix cache, then its changes, each message with the load; ends
        UNAVAILABLE when the core dies or the service drains, RESOURCE_EXHAUSTED when the caller lags."""
        if self.state.draining:
            raise UnavailableError("engine is draining")
        if self._drain_watch is None:
            self._drain_watch = asyncio.ensure_future(self._end_kv_events_on_drain())
        block_size = self.info.block_size
        stream = self.engine.kv_events()
        async with contextlib.aclosing(stream):
            async for batch in stream:
                load = load_report(self.engine.stats(), self.engine.num_finished_requests, self.state.draining)
                yield kv_events_response(batch, block_size, load)

    async def _end_kv_events_on_drain(self) -> None:
        """Subscriptions never end alone: end them when the drain starts, so they do not hold up its grace."""
        await self.state.drain_started.wait()
        self.engine.end_kv_events(UnavailableError("engine is draining"))


def _batch_code_of(exc: BaseException) -> str:
    """A multiplexed request's status name: a request the caller gave up was cancelled, whatever the call does."""
    return CANCELLED if isinstance(exc, asyncio.CancelledError) else status_code_name(exc)


def engine_info(description) -> engine_pb2.GetEngineInfoResponse:
    """GetEngineInfo from an EngineDescription (services.engine.serving.engine_process.describe)."""
    return engine_pb2.GetEngineInfoResponse(**description.fields)

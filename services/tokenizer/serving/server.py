"""grpc.aio adapter of the public TextGenerationService: tokenize, stream the engine call, detokenize."""

import asyncio
import logging
import uuid

import grpc
from llmserve.common.v1 import common_pb2
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc

from services.common.convert import RequestClock
from services.common.errors import UnavailableError
from services.common.grpc_server import ServingState, request_id_var, status_code_name
from services.common.metrics import RequestObserver, RequestRecord
from services.common.validation import check_request_id, loggable_request_id
from services.tokenizer.serving.convert import ResolvedRequest, check_ids, prompt_ids, resolve_generate
from services.tokenizer.serving.engine_client import (
    EngineClient, EngineStream, is_retryable_elsewhere, upstream_error, watch_engine)
from services.tokenizer.serving.engine_pool import EnginePool, Member, SingleEngine
from services.tokenizer.limits import INLINE_MAX_CHARS, InputLimits
from services.tokenizer.serving.metrics import record_engine_result
from services.tokenizer.text_stream import TextStream
from services.tokenizer.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)
SERVICE_NAME = textgen_pb2.DESCRIPTOR.services_by_name["TextGenerationService"].full_name


class TextGenerationServicer(textgen_pb2_grpc.TextGenerationServiceServicer):
    """Text in, text deltas out; the engines see only token ids."""

    def __init__(self, tokenizer: TextTokenizer, engines: EnginePool | EngineClient, state: ServingState,
                 default_max_tokens: int = 256, limits: InputLimits | None = None, metrics=None):
        """engines: the EnginePool, or one EngineClient that the caller keeps checked (keep_health_in_step).
        metrics: this worker's TokenizerMetrics (services.tokenizer.serving.metrics), or None when they are off."""
        self.tokenizer = tokenizer
        self.requests = RequestObserver(logger, metrics)
        self.limits = limits if limits is not None else InputLimits.of(tokenizer)
        self.engines = SingleEngine(engines) if isinstance(engines, EngineClient) else engines
        self.state = state
        self.default_max_tokens = default_max_tokens

    def register(self, server: grpc.aio.Server) -> None:
        textgen_pb2_grpc.add_TextGenerationServiceServicer_to_server(self, server)

    async def Generate(self, request: textgen_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        clock = RequestClock()
        request_id = request.request_id or uuid.uuid4().hex
        with self.requests.track(loggable_request_id(request_id), clock, lambda exc: status_code_name(exc, context)) as record:
            if request.request_id:
                check_request_id(request.request_id)
            request_id_var.set(request_id)
            await self._generate(request, request_id, clock, context, record)

    async def _generate(self, request: textgen_pb2.GenerateRequest, request_id: str, clock: RequestClock,
                        context: grpc.aio.ServicerContext, record: RequestRecord) -> None:
        if self.state.draining:
            raise UnavailableError("tokenizer service is draining")
        info = await self.engines.settled_info()
        size = self.limits.check_prompt(request, info.max_model_len)
        args = (request, request_id, self.tokenizer, info.max_model_len, self.default_max_tokens)
        # NOTE: a short prompt is tokenized inline: that takes far less than a thread hop.
        resolved = resolve_generate(*args) if size <= INLINE_MAX_CHARS else await asyncio.to_thread(
            resolve_generate, *args)
        num_completions = resolved.sampling.n if resolved.sampling.HasField("n") else 1
        text_streams = [TextStream(self.tokenizer, resolved.prompt_ids, resolved.stops,
                                   resolved.include_stop_str_in_output, resolved.skip_special_tokens)
                        for _ in range(num_completions)]
        record.num_prompt_tokens, record.admitted = len(resolved.prompt_ids), True
        member, stream, first = await self._start(resolved, context, record)
        try:
            await self._relay(stream, first, resolved, text_streams, clock, context, record, member.client)
        except grpc.aio.AioRpcError as exc:
            record.engine_code = exc.code().name
            raise upstream_error(exc) from None
        finally:
            stream.cancel()
            self.engines.release(member)

    async def _start(self, resolved: ResolvedRequest, context: grpc.aio.ServicerContext, record: RequestRecord):
        """(replica, its stream, the stream's first take()): a replica that is full or gone before its first
        message hands the request to another one, each tried once; the last one's status goes to the client.
        `record` names the attempt the request ends on; the metrics count the earlier attempts here."""
        request = resolved.engine_request()
        tried: list[Member] = []
        while (member := self.engines.pick(resolved.prompt_ids, tried)) is not None:
            if tried:
                record_engine_result(record.engine, record.engine_code)
            record.engine, record.engine_code = member.address, None
            stream = member.client.open_stream(request, context.time_remaining())
            try:
                return member, stream, await stream.take()
            except grpc.aio.AioRpcError as exc:
                stream.cancel()
                self.engines.release(member)
                record.engine_code = exc.code().name
                if not is_retryable_elsewhere(exc):
                    raise upstream_error(exc) from None
                tried.append(member)
                error = exc
                logger.info("engine %s answered %s; trying another replica", member.address, exc.code().name)
            except BaseException:
                stream.cancel()
                self.engines.release(member)
                raise
        if tried:
            raise upstream_error(error) from None
        raise UnavailableError("no engine replica is available")

    async def _relay(self, stream: EngineStream, first: tuple, resolved: ResolvedRequest,
                     text_streams: list[TextStream], clock: RequestClock, context: grpc.aio.ServicerContext,
                     record: RequestRecord, engine: EngineClient) -> None:
        """Engine messages -> client messages, one per batch of ids that arrived while the previous write was
        under way; returns once every completion (one TextStream per sampling.n index) has finished, and the
        caller cancels the engine call (which aborts the engine request). A stop-string match finishes its
        completion only: while others go on, the engine is told to abort that one (before its final message is
        written, so a client that saw it knows the engine stopped it) and its later messages are dropped.

        Written with context.write rather than yielded: no async generators between the relay and gRPC.
        The timing on each last message is this service's own (RequestTiming is measured by its sender).
        """
        num_ids = [0] * len(text_streams)
        unfinished = set(range(len(text_streams)))
        taken = first
        while unfinished:
            ids, engine_response = taken if taken is not None else await stream.take()
            taken = None
            if engine_response is None:
                raise UnavailableError("the engine stream ended without a finish reason")
            index = engine_response.index
            logprobs = stream.take_logprobs()
            prompt_logprobs = stream.take_prompt_logprobs()
            if index not in unfinished:
                continue
            if ids:
                clock.mark_token()
            text_stream = text_streams[index]
            ids, delta, matched = _push(text_stream, ids, bool(resolved.stops))
            num_ids[index] += len(ids)
            record.num_completion_tokens = sum(num_ids)  # a cancelled call logs its count
            response = textgen_pb2.GenerateResponse(request_id=resolved.request_id, text=delta, token_ids=ids,
                                                    usage=engine_response.usage, index=index)
            if logprobs:
                response.logprobs.extend(client_logprobs(self.tokenizer, logprobs, len(ids)))
            if prompt_logprobs:  # once; up to 21 texts per prompt token: decoded off the event loop
                response.prompt_logprobs.extend(await asyncio.to_thread(
                    client_logprobs, self.tokenizer, prompt_logprobs, len(prompt_logprobs)))
            if matched is not None:
                response.usage.completion_tokens = num_ids[index]  # the ids past the match are not the client's
                response.finish_reason = common_pb2.FINISH_REASON_STOP
                response.matched_stop_string = matched
            elif engine_response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                response.text += text_stream.finish()
                response.finish_reason = engine_response.finish_reason
                if engine_response.HasField("matched_stop_token_id"):
                    response.matched_stop_token_id = engine_response.matched_stop_token_id
            if response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                unfinished.discard(index)
                if matched is not None and unfinished and not _held_back(resolved.sampling):
                    await engine.abort_completion(engine_response.request_id, index)
                response.timing.CopyFrom(clock.to_proto())
                if not unfinished:
                    _finish(record, response)
            await context.write(response)

    async def Tokenize(self, request: textgen_pb2.TokenizeRequest, context) -> textgen_pb2.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return await asyncio.to_thread(self._tokenize, request, add_special)

    def _tokenize(self, request: textgen_pb2.TokenizeRequest, add_special: bool) -> textgen_pb2.TokenizeResponse:
        _, ids = prompt_ids(request, self.tokenizer, add_special)
        return textgen_pb2.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.tokens(ids))

    async def Detokenize(self, request: textgen_pb2.DetokenizeRequest, context) -> textgen_pb2.DetokenizeResponse:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        if len(request.token_ids) <= INLINE_MAX_CHARS:
            return textgen_pb2.DetokenizeResponse(text=self._detokenize(request.token_ids, skip))
        return textgen_pb2.DetokenizeResponse(text=await asyncio.to_thread(self._detokenize, request.token_ids, skip))

    def _detokenize(self, token_ids, skip_special_tokens: bool) -> str:
        ids = list(token_ids)
        check_ids("token_ids", ids, self.tokenizer.vocab_size)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def GetModelInfo(self, request, context) -> textgen_pb2.GetModelInfoResponse:
        info = await self.engines.settled_info()
        defaults = self.tokenizer.generation_defaults()
        sampling = common_pb2.SamplingParams(temperature=defaults["temperature"], top_p=defaults["top_p"],
                                             min_p=defaults["min_p"], max_tokens=self.default_max_tokens)
        if defaults["top_k"]:
            sampling.top_k = int(defaults["top_k"])
        if defaults["repetition_penalty"] != 1.0:
            sampling.repetition_penalty = defaults["repetition_penalty"]
        response = textgen_pb2.GetModelInfoResponse(
            model_name=info.model_name or self.tokenizer.name, vocab_size=self.tokenizer.vocab_size,
            max_model_len=info.max_model_len, eos_token_ids=self.tokenizer.eos_token_ids,
            has_chat_template=self.tokenizer.has_chat_template, default_sampling=sampling,
            architecture=info.architecture)
        if self.tokenizer.bos_token_id is not None:
            response.bos_token_id = self.tokenizer.bos_token_id
        return response


async def keep_health_in_step(engine: EngineClient, state: ServingState) -> None:
    """Report ready only while one engine answers with a matching tokenizer (the single-client wiring)."""
    await watch_engine(engine, health_follower(state))


def health_follower(state: ServingState):
    """on_ready for the EnginePool: ready while an engine replica answers with a matching tokenizer."""

    async def on_change(ready: bool) -> None:
        if not state.draining:
            await state.mark_ready(ready)

    return on_change


def _finish(record: RequestRecord, response: textgen_pb2.GenerateResponse) -> None:
    usage = response.usage
    record.finish(response.finish_reason, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


def _held_back(sampling: common_pb2.SamplingParams) -> bool:
    """best_of > n: the engine sends every completion whole once all have finished (none is left to abort)."""
    return sampling.HasField("best_of") and sampling.best_of > max(sampling.n, 1)


def _push(text_stream: TextStream, ids: list[int], has_stops: bool) -> tuple[list[int], str, str | None]:
    """(ids, delta, matched stop string) for a batch of ids; on a match the ids end at the token that completed it."""
    if not has_stops or len(ids) <= 1:
        return (ids, *text_stream.push(ids))
    deltas = []
    for count, token_id in enumerate(ids, start=1):
        delta, matched = text_stream.push((token_id,))
        deltas.append(delta)
        if matched is not None:
            return ids[:count], "".join(deltas), matched
    return ids, "".join(deltas), None


def client_logprobs(tokenizer: TextTokenizer, logprobs: list, num_ids: int) -> list:
    """The engine's PositionLogprobs of the first `num_ids` ids (those the client gets: a stop-string match cuts
    the batch), with each token's text filled in (one batched decode)."""
    positions = [common_pb2.PositionLogprobs() for _ in logprobs[:num_ids]]
    for position, engine_position in zip(positions, logprobs):
        position.CopyFrom(engine_position)  # keeps an unset `sampled` unset (the first prompt token's)
    entries = []
    for position in positions:
        if position.HasField("sampled"):
            entries.append(position.sampled)
        entries.extend(position.top)
    for entry, text in zip(entries, tokenizer.token_texts([entry.token_id for entry in entries])):
        entry.text = text
    return positions

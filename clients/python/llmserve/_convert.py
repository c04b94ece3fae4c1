"""Conversions between the client's Python values and the textgen.v1 protobuf messages (no I/O here)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import grpc
from google.protobuf.message import Message

from llmserve.common.v1 import common_pb2
from llmserve.datatypes import (
    ChatMessage,
    FinishReason,
    GenerationResult,
    ModelInfo,
    PositionLogprobs,
    Timing,
    TokenizeResult,
    TokenLogprob,
    Usage,
)
from llmserve.errors import LLMServeError
from llmserve.textgen.v1 import textgen_pb2

MessageLike = ChatMessage | Mapping[str, str] | tuple[str, str]

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "num_logprobs",
    "num_prompt_logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "best_of",
)
# Structured output: at most one (a oneof in SamplingParams); json_schema may also be given as a dict.
CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar", "json_object")


class GenerateOptions(TypedDict, total=False):
    """Keyword options of generate()/complete(). None (or leaving one out) means the server's default."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    max_tokens: int | None
    min_tokens: int | None
    ignore_eos: bool | None
    num_logprobs: int | None
    num_prompt_logprobs: int | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    n: int | None
    best_of: int | None
    json_schema: str | Mapping[str, Any] | None
    regex: str | None
    grammar: str | None
    json_object: bool | None
    stop_token_ids: Sequence[int] | None
    stop: str | Sequence[str] | None
    skip_special_tokens: bool | None
    include_stop_str_in_output: bool | None
    request_id: str | None


_REQUEST_OPTIONS = ("skip_special_tokens", "include_stop_str_in_output")


def to_chat(messages: Sequence[MessageLike]) -> textgen_pb2.ChatMessages:
    """Chat messages from ChatMessage records, {"role", "content"} mappings or (role, content) pairs."""
    chat = textgen_pb2.ChatMessages()
    for message in messages:
        if isinstance(message, ChatMessage):
            role, content = message.role, message.content
        elif isinstance(message, Mapping):
            role, content = message["role"], message["content"]
        else:
            role, content = message
        chat.messages.add(role=role, content=content)
    return chat


def _is_chat(prompt: object) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and any(
        not isinstance(item, int) for item in prompt
    )


def build_generate_request(
    prompt: str | Sequence[int] | Sequence[MessageLike] | None,
    messages: Sequence[MessageLike] | None,
    options: Mapping[str, Any],
) -> textgen_pb2.GenerateRequest:
    """A GenerateRequest from a prompt (text, token ids or chat messages) or `messages`, and keyword options."""
    unknown = set(options) - set(GenerateOptions.__annotations__)
    if unknown:
        raise TypeError(f"unknown generate option(s): {', '.join(sorted(unknown))}")
    if (prompt is None) == (messages is None):
        raise TypeError("pass exactly one of a prompt or messages=")
    request = textgen_pb2.GenerateRequest(request_id=options.get("request_id") or "")
    if messages is not None or _is_chat(prompt):
        request.chat.CopyFrom(to_chat(messages if messages is not None else prompt))  # type: ignore[arg-type]
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    for name in SAMPLING_FIELDS:
        if options.get(name) is not None:
            setattr(request.sampling, name, options[name])
    request.sampling.stop_token_ids.extend(options.get("stop_token_ids") or ())
    _set_constraint(request.sampling, options)
    stop = options.get("stop")
    request.stop.extend([stop] if isinstance(stop, str) else (stop or ()))
    for name in _REQUEST_OPTIONS:
        if options.get(name) is not None:
            setattr(request, name, options[name])
    return request


def _set_constraint(sampling: common_pb2.SamplingParams, options: Mapping[str, Any]) -> None:
    given = [name for name in CONSTRAINT_FIELDS if options.get(name) is not None]
    if len(given) > 1:
        raise TypeError(f"pass at most one of {', '.join(CONSTRAINT_FIELDS)}; got {', '.join(given)}")
    for name in given:
        value = options[name]
        if name == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)
        setattr(sampling, name, value)


def build_tokenize_request(
    text: str | None,
    messages: Sequence[MessageLike] | None,
    add_special_tokens: bool | None,
    add_generation_prompt: bool | None,
) -> textgen_pb2.TokenizeRequest:
    """A TokenizeRequest for exactly one of text or chat messages."""
    if (text is None) == (messages is None):
        raise TypeError("pass exactly one of text or messages=")
    request = textgen_pb2.TokenizeRequest()
    if text is not None:
        request.text = text
    else:
        request.chat.CopyFrom(to_chat(messages))  # type: ignore[arg-type]
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    if add_generation_prompt is not None:
        request.add_generation_prompt = add_generation_prompt
    return request


def set_fields(message: Message) -> dict[str, Any]:
    """The fields of a message that are set, by name (for optional scalars: the ones present)."""
    return {descriptor.name: value for descriptor, value in message.ListFields()}


def _timing(message: common_pb2.RequestTiming) -> Timing:
    def seconds(name: str) -> float | None:
        return getattr(message, name).ToTimedelta().total_seconds() if message.HasField(name) else None

    arrival = message.arrival_time.ToDatetime() if message.HasField("arrival_time") else None
    return Timing(arrival, seconds("queue_duration"), seconds("time_to_first_token"), seconds("total_duration"))


def _logprobs(position: common_pb2.PositionLogprobs) -> PositionLogprobs:
    sampled = None
    if position.HasField("sampled"):
        sampled = TokenLogprob(position.sampled.token_id, position.sampled.logprob, position.sampled.text)
    return PositionLogprobs(sampled, tuple(TokenLogprob(t.token_id, t.logprob, t.text) for t in position.top))


class ResultBuilder:
    """Accumulates a Generate stream and checks its shape: messages, one carrying the finish reason, then the end."""

    __slots__ = ("_request_id", "_n", "_completions")

    def __init__(self, request_id: str, n: int = 1) -> None:
        self._request_id = request_id
        self._n = max(n, 1)  # sampling.n: the stream ends after this many completions finished
        self._completions = [_Completion() for _ in range(self._n)]

    @property
    def request_id(self) -> str:
        """The caller's request id, or the server's once the first message arrived."""
        return self._request_id

    @property
    def finished(self) -> bool:
        """Whether every completion's message carrying its finish reason has arrived."""
        return all(completion.finished for completion in self._completions)

    def add(self, response: textgen_pb2.GenerateResponse) -> str:
        """Record one message and return its text delta (of completion `response.index`)."""
        if response.index >= self._n:
            raise LLMServeError(grpc.StatusCode.INTERNAL, f"server sent completion index {response.index} of n={self._n}")
        completion = self._completions[response.index]
        if completion.finished:
            raise LLMServeError(grpc.StatusCode.INTERNAL, "server sent a message after the finishing one")
        self._request_id = response.request_id or self._request_id
        completion.add(response)
        return response.text

    def result(self) -> GenerationResult:
        """The final result (completion 0's, with every completion in `completions` when n > 1); raises
        LLMServeError if the stream ended without a finish reason."""
        if not self.finished:
            raise LLMServeError(grpc.StatusCode.INTERNAL, "stream ended without a finish reason")
        results = [completion.result(self._request_id) for completion in self._completions]
        if self._n > 1:
            results[0].completions = results
        return results[0]


class _Completion:
    """The messages of one completion (one index) of a Generate stream."""

    __slots__ = ("texts", "token_ids", "logprobs", "prompt_logprobs", "last")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] = []
        self.prompt_logprobs: list[PositionLogprobs] = []
        self.last: textgen_pb2.GenerateResponse | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    def add(self, response: textgen_pb2.GenerateResponse) -> None:
        self.texts.append(response.text)
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(_logprobs(p) for p in response.logprobs)
        self.prompt_logprobs.extend(_logprobs(p) for p in response.prompt_logprobs)
        self.last = response

    def result(self, request_id: str) -> GenerationResult:
        last = self.last
        assert last is not None
        usage = Usage(last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens)
        return GenerationResult(
            request_id=request_id,
            text="".join(self.texts),
            token_ids=self.token_ids,
            finish_reason=FinishReason(last.finish_reason),
            usage=usage,
            matched_stop_token_id=(
                last.matched_stop_token_id if last.HasField("matched_stop_token_id") else None
            ),
            matched_stop_string=last.matched_stop_string if last.HasField("matched_stop_string") else None,
            timing=_timing(last.timing) if last.HasField("timing") else None,
            logprobs=self.logprobs,
            index=last.index,
            prompt_logprobs=self.prompt_logprobs,
        )


def tokenize_result(response: textgen_pb2.TokenizeResponse) -> TokenizeResult:
    """A TokenizeResult from the protobuf response."""
    return TokenizeResult(list(response.token_ids), list(response.tokens))


def model_info(response: textgen_pb2.GetModelInfoResponse) -> ModelInfo:
    """A ModelInfo from the protobuf response."""
    return ModelInfo(
        model_name=response.model_name,
        architecture=response.architecture,
        vocab_size=response.vocab_size,
        max_model_len=response.max_model_len,
        eos_token_ids=tuple(response.eos_token_ids),
        bos_token_id=response.bos_token_id if response.HasField("bos_token_id") else None,
        has_chat_template=response.has_chat_template,
        default_sampling={
            name: list(value) if name == "stop_token_ids" else value
            for name, value in set_fields(response.default_sampling).items()
        },
    )

"""Typed clients of llmserve's public API (llmserve.textgen.v1.TextGenerationService), sync and asyncio.

    with LLMServeClient("localhost:50051") as client:
        stream = client.generate("Once upon a time", max_tokens=32, temperature=0)
        for delta in stream:
            print(delta, end="", flush=True)
        print(stream.result().finish_reason)

Every failed call raises LLMServeError (status code, message, BadRequest field violations, RetryInfo delay).
With `retry=N` (or a llmserve.RetryPolicy), on the client or on one call, a call the server refused before
sending anything (RESOURCE_EXHAUSTED, UNAVAILABLE) is retried with backoff, waiting RetryInfo's delay when
the server gave one; a stream that already received a message is never retried.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve._convert import (
    GenerateOptions,
    MessageLike,
    ResultBuilder,
    build_generate_request,
    build_tokenize_request,
    model_info,
    tokenize_result,
)
from llmserve.datatypes import GenerationResult, ModelInfo, ServingStatus, TokenizeResult
from llmserve.errors import error_from_rpc
from llmserve.retry import AsyncRetrier, Retrier, RetryPolicy, async_call_with_retry, call_with_retry
from llmserve.stream import AsyncGenerationStream, GenerationStream
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc

DEFAULT_TARGET = "localhost:50051"
TARGET_ENV = "LLMSERVE_TARGET"
SERVICE_NAME = textgen_pb2.DESCRIPTOR.services_by_name["TextGenerationService"].full_name

Prompt = str | Sequence[int] | Sequence[MessageLike]
Retry = RetryPolicy | int | None
_DEFAULT = object()  # a call's `retry` left out: the client's policy applies


def resolve_target(target: str | None) -> str:
    """The target to dial: the given one, else $LLMSERVE_TARGET, else localhost:50051."""
    return target or os.environ.get(TARGET_ENV) or DEFAULT_TARGET


class _ClientBase:
    def __init__(
        self,
        channel_module: Any,
        target: str | None,
        credentials: grpc.ChannelCredentials | None,
        options: Sequence[tuple[str, Any]],
        metadata: Sequence[tuple[str, str]],
        retry: Retry,
    ) -> None:
        self.target = resolve_target(target)
        self.retry = RetryPolicy.of(retry)
        if credentials is None:
            self._channel = channel_module.insecure_channel(self.target, options=list(options))
        else:
            self._channel = channel_module.secure_channel(self.target, credentials, options=list(options))
        self._stub = textgen_pb2_grpc.TextGenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = tuple(metadata)

    def _policy(self, retry: Any) -> RetryPolicy | None:
        return self.retry if retry is _DEFAULT else RetryPolicy.of(retry)


class LLMServeClient(_ClientBase):
    """A blocking client. `target` defaults to $LLMSERVE_TARGET or localhost:50051; `credentials` enable TLS."""

    def __init__(
        self,
        target: str | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        metadata: Sequence[tuple[str, str]] = (),
        retry: Retry = None,
    ) -> None:
        super().__init__(grpc, target, credentials, options, metadata, retry)

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        def invoke(remaining: float | None) -> Any:
            return method(request, timeout=remaining, metadata=self._metadata)

        return call_with_retry(self.retry, timeout, invoke, error_from_rpc)

    def generate(
        self,
        prompt: Prompt | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        timeout: float | None = None,
        retry: Retry | object = _DEFAULT,
        **options: Unpack[GenerateOptions],
    ) -> GenerationStream:
        """Start generating for a text, token-id or chat prompt; iterate the result for text deltas.

        Options are the sampling fields (temperature, top_p, top_k, min_p, seed, max_tokens, min_tokens,
        ignore_eos, num_logprobs, num_prompt_logprobs, repetition_penalty, presence_penalty, frequency_penalty,
        stop_token_ids, n, best_of: with best_of > n the n chosen completions arrive whole once all have finished),
        at most one structured-output constraint (json_schema as JSON text or a dict, regex, grammar in EBNF,
        json_object=True), stop strings, skip_special_tokens, include_stop_str_in_output and request_id; left out
        or None means the server's default. `timeout` bounds the whole stream, retries included; `retry` (a
        RetryPolicy, a number of retries, or None) overrides the client's policy.
        """
        request = build_generate_request(prompt, messages, options)
        retrier = Retrier(self._policy(retry), timeout, lambda remaining: self._stub.Generate(
            request, timeout=remaining, metadata=self._metadata))
        return GenerationStream(retrier.first(), ResultBuilder(request.request_id, request.sampling.n), retrier)

    def complete(
        self,
        prompt: Prompt | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        timeout: float | None = None,
        retry: Retry | object = _DEFAULT,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult:
        """Generate and return the whole result at once (same arguments as generate())."""
        return self.generate(prompt, messages=messages, timeout=timeout, retry=retry, **options).result()

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        timeout: float | None = None,
    ) -> TokenizeResult:
        """Token ids for text or chat messages, as Generate would see them."""
        request = build_tokenize_request(text, messages, add_special_tokens, add_generation_prompt)
        return tokenize_result(self._unary(self._stub.Tokenize, request, timeout))

    def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> str:
        """The text of token ids."""
        request = textgen_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self._unary(self._stub.Detokenize, request, timeout).text

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model and the server's sampling defaults."""
        return model_info(self._unary(self._stub.GetModelInfo, textgen_pb2.GetModelInfoRequest(), timeout))

    def health(self, service: str = SERVICE_NAME, *, timeout: float | None = None) -> ServingStatus:
        """grpc.health.v1 Check: by default readiness of the text-generation service ("" = liveness)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return ServingStatus(self._unary(self._health.Check, request, timeout).status)

    def close(self) -> None:
        """Close the channel (cancelling calls still running)."""
        self._channel.close()

    def __enter__(self) -> LLMServeClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncLLMServeClient(_ClientBase):
    """The asyncio client; the same methods as LLMServeClient, awaited (generate() returns an async stream)."""

    def __init__(
        self,
        target: str | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        metadata: Sequence[tuple[str, str]] = (),
        retry: Retry = None,
    ) -> None:
        super().__init__(grpc.aio, target, credentials, options, metadata, retry)

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        async def invoke(remaining: float | None) -> Any:
            return await method(request, timeout=remaining, metadata=self._metadata)

        return await async_call_with_retry(self.retry, timeout, invoke, error_from_rpc)

    def generate(
        self,
        prompt: Prompt | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        timeout: float | None = None,
        retry: Retry | object = _DEFAULT,
        **options: Unpack[GenerateOptions],
    ) -> AsyncGenerationStream:
        """Start generating; `async for` the result for text deltas (arguments as LLMServeClient.generate)."""
        request = build_generate_request(prompt, messages, options)
        retrier = AsyncRetrier(self._policy(retry), timeout, lambda remaining: self._stub.Generate(
            request, timeout=remaining, metadata=self._metadata))
        return AsyncGenerationStream(retrier.first(), ResultBuilder(request.request_id, request.sampling.n), retrier)

    async def complete(
        self,
        prompt: Prompt | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        timeout: float | None = None,
        retry: Retry | object = _DEFAULT,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult:
        """Generate and return the whole result at once."""
        return await self.generate(prompt, messages=messages, timeout=timeout, retry=retry, **options).result()

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        timeout: float | None = None,
    ) -> TokenizeResult:
        """Token ids for text or chat messages, as Generate would see them."""
        request = build_tokenize_request(text, messages, add_special_tokens, add_generation_prompt)
        return tokenize_result(await self._unary(self._stub.Tokenize, request, timeout))

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> str:
        """The text of token ids."""
        request = textgen_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, request, timeout)).text

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model and the server's sampling defaults."""
        request = textgen_pb2.GetModelInfoRequest()
        return model_info(await self._unary(self._stub.GetModelInfo, request, timeout))

    async def health(self, service: str = SERVICE_NAME, *, timeout: float | None = None) -> ServingStatus:
        """grpc.health.v1 Check: by default readiness of the text-generation service ("" = liveness)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return ServingStatus((await self._unary(self._health.Check, request, timeout)).status)

    async def close(self) -> None:
        """Close the channel (cancelling calls still running)."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncLLMServeClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

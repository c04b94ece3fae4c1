"""Running Generate calls: iterate (or `async for`) them for text deltas, then take the whole result."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from llmserve._convert import ResultBuilder
from llmserve.datatypes import GenerationResult
from llmserve.errors import LLMServeError, error_from_rpc
from llmserve.retry import AsyncRetrier, Retrier


class GenerationStream:
    """A running Generate call: iterate it for text deltas; result() drains the rest and returns the outcome.

    With a `retrier` (llmserve.retry), a call refused before its first message is started again.
    """

    def __init__(self, call: Any, builder: ResultBuilder, retrier: Retrier | None = None) -> None:
        self._call = call
        self._builder = builder
        self._retrier = retrier
        self._received = False

    @property
    def request_id(self) -> str:
        """The caller's request id, or the server's once the first message arrived."""
        return self._builder.request_id

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                for response in self._call:
                    self._received = True
                    delta = self._builder.add(response)
                    if delta:
                        yield delta
                return
            except grpc.RpcError as err:
                error = error_from_rpc(err)
            # NOTE: never after a message: the request ran, and a retry would run it again.
            if self._received or self._retrier is None:
                raise error
            self._call = self._retrier.next(error)

    def result(self) -> GenerationResult:
        """Consume whatever is left of the stream and return the whole result."""
        for _ in self:
            pass
        return self._builder.result()

    def cancel(self) -> None:
        """Cancel the call; the server aborts the request and frees its memory."""
        self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._builder.finished:
            self.cancel()


class AsyncGenerationStream:
    """The asyncio GenerationStream: `async for` it for text deltas; `await result()` for the outcome."""

    def __init__(self, call: Any, builder: ResultBuilder, retrier: AsyncRetrier | None = None) -> None:
        self._call = call
        self._builder = builder
        self._retrier = retrier
        self._received = False
        self._cancelled = False

    @property
    def request_id(self) -> str:
        """The caller's request id, or the server's once the first message arrived."""
        return self._builder.request_id

    def __aiter__(self) -> AsyncIterator[str]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[str]:
        while True:
            error = None
            try:
                response = await self._call.read()
            except grpc.RpcError as err:
                error = error_from_rpc(err)
            except asyncio.CancelledError:
                if not self._cancelled:
                    raise
                raise LLMServeError(grpc.StatusCode.CANCELLED, "cancelled by the client") from None
            if error is not None:
                # NOTE: never after a message: the request ran, and a retry would run it again.
                if self._received or self._retrier is None or self._cancelled:
                    raise error
                self._call = await self._retrier.next(error)
                continue
            if response is grpc.aio.EOF:
                return
            self._received = True
            delta = self._builder.add(response)
            if delta:
                yield delta

    async def result(self) -> GenerationResult:
        """Consume whatever is left of the stream and return the whole result."""
        async for _ in self:
            pass
        return self._builder.result()

    def cancel(self) -> None:
        """Cancel the call; the server aborts the request and frees its memory."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._builder.finished:
            self.cancel()

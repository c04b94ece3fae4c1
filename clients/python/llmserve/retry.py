"""Retrying calls the server refused before doing anything: RESOURCE_EXHAUSTED (a full queue) and UNAVAILABLE.

Opt-in: a client (or one call) given `retry=RetryPolicy(...)` or `retry=N` re-sends a refused call after a
delay: the server's google.rpc.RetryInfo delay when it sent one, else exponential backoff with jitter.
A Generate stream is retried only while no message has arrived: once a message was received, the request
ran, and a retry would run it again (its tokens, its cost), so that error goes to the caller as it is.
The call's `timeout` bounds all attempts together; a delay that would end past it is not waited for.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from llmserve.errors import LLMServeError

RETRYABLE_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How many times to re-send a refused call, and how long to wait before each.

    The delay before retry n (0-based) is the server's RetryInfo delay when present (at least it, plus up
    to `jitter` of it, so refused clients do not come back all at once), else
    min(max_backoff_s, initial_backoff_s * multiplier**n) scaled by a random factor in [1 - jitter, 1].
    """

    max_retries: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError(f"invalid retry policy: {self}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    @classmethod
    def of(cls, retry: RetryPolicy | int | None) -> RetryPolicy | None:
        """A policy from what a caller passed: a policy, a number of retries, or None (no retries)."""
        if retry is None or isinstance(retry, RetryPolicy):
            return retry
        return cls(max_retries=retry) if retry > 0 else None

    def delay_s(self, attempt: int, error: LLMServeError) -> float | None:
        """Seconds to wait before retry `attempt` (0-based) after `error`; None when it is not to be retried."""
        if error.code not in RETRYABLE_CODES or attempt >= self.max_retries:
            return None
        if error.retry_delay_s is not None:
            return error.retry_delay_s * (1 + self.jitter * random.random())
        backoff = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt)
        return backoff * (1 - self.jitter * random.random())


class _Attempts:
    """The attempts of one call: which one this is, and how much of its timeout is left."""

    def __init__(self, policy: RetryPolicy | None, timeout: float | None) -> None:
        self.policy = policy
        self.attempt = 0
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def next_delay(self, error: LLMServeError) -> float | None:
        """The delay before the next attempt, or None to give up (and raise `error`)."""
        if self.policy is None:
            return None
        delay = self.policy.delay_s(self.attempt, error)
        remaining = self.remaining()
        if delay is None or (remaining is not None and delay >= remaining):
            return None
        self.attempt += 1
        return delay


def sleep(seconds: float) -> None:
    """Blocking wait between attempts (a module function, so tests can record delays instead of waiting)."""
    time.sleep(seconds)


async def async_sleep(seconds: float) -> None:
    """The asyncio wait between attempts."""
    await asyncio.sleep(seconds)


class Retrier:
    """Starts a call and, on a refusal, the next attempt after its delay (blocking)."""

    def __init__(self, policy: RetryPolicy | None, timeout: float | None, start: Callable[[float | None], Any]):
        """`start(timeout_left)` starts one attempt and returns its call."""
        self._attempts = _Attempts(policy, timeout)
        self._start = start

    def first(self) -> Any:
        return self._start(self._attempts.remaining())

    def next(self, error: LLMServeError) -> Any:
        """The next attempt's call after `error`; raises `error` when it is final."""
        delay = self._attempts.next_delay(error)
        if delay is None:
            raise error
        sleep(delay)
        return self._start(self._attempts.remaining())


class AsyncRetrier:
    """The asyncio Retrier: `await next(error)` waits without blocking the event loop."""

    def __init__(self, policy: RetryPolicy | None, timeout: float | None, start: Callable[[float | None], Any]):
        self._attempts = _Attempts(policy, timeout)
        self._start = start

    def first(self) -> Any:
        return self._start(self._attempts.remaining())

    async def next(self, error: LLMServeError) -> Any:
        delay = self._attempts.next_delay(error)
        if delay is None:
            raise error
        await async_sleep(delay)
        return self._start(self._attempts.remaining())


def call_with_retry(policy: RetryPolicy | None, timeout: float | None, invoke: Callable[[float | None], Any],
                    convert: Callable[[grpc.RpcError], LLMServeError]) -> Any:
    """A unary call `invoke(timeout_left)`, retried per `policy` (a unary call has no partial result to lose)."""
    retrier = Retrier(policy, timeout, lambda remaining: remaining)
    remaining = retrier.first()
    while True:
        try:
            return invoke(remaining)
        except grpc.RpcError as err:
            error = convert(err)
        remaining = retrier.next(error)


async def async_call_with_retry(policy: RetryPolicy | None, timeout: float | None,
                                invoke: Callable[[float | None], Awaitable[Any]],
                                convert: Callable[[grpc.RpcError], LLMServeError]) -> Any:
    """The asyncio call_with_retry."""
    retrier = AsyncRetrier(policy, timeout, lambda remaining: remaining)
    remaining = retrier.first()
    while True:
        try:
            return await invoke(remaining)
        except grpc.RpcError as err:
            error = convert(err)
        remaining = await retrier.next(error)

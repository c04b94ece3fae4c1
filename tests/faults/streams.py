"""Generate streams as the fault tests see them: how each ended, with what, and whether it kept the contract."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from llmserve.common.v1 import common_pb2
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc

UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED
LENGTH = common_pb2.FINISH_REASON_LENGTH


@dataclass(slots=True)
class Outcome:
    """One Generate call: its status, every token id and message, and the finish reasons seen (in order)."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_messages: int = 0
    finish_reasons: list[int] = field(default_factory=list)  # one entry per message
    request_ids: set[str] = field(default_factory=set)
    completion_tokens: int = 0  # usage on the last message
    error: grpc.RpcError | None = None  # the failed call, for its status details

    def contract_violations(self) -> list[str]:
        """What breaks "messages, then one carrying the finish reason, then OK" (empty when nothing does)."""
        if self.code != grpc.StatusCode.OK:
            return []
        problems = []
        ends = [i for i, reason in enumerate(self.finish_reasons) if reason != UNSPECIFIED]
        if ends != [self.num_messages - 1]:
            problems.append(f"finish reasons at messages {ends} of {self.num_messages}")
        if len(self.request_ids) != 1:
            problems.append(f"request ids {sorted(self.request_ids)}")
        if self.completion_tokens != len(self.token_ids):
            problems.append(f"usage says {self.completion_tokens} tokens, the stream carried {len(self.token_ids)}")
        return problems

    @property
    def finish_reason(self) -> int:
        return self.finish_reasons[-1] if self.finish_reasons else UNSPECIFIED


def _take(outcome: Outcome, response: textgen_pb2.GenerateResponse) -> None:
    outcome.num_messages += 1
    outcome.token_ids += response.token_ids
    outcome.finish_reasons.append(response.finish_reason)
    outcome.request_ids.add(response.request_id)
    outcome.completion_tokens = response.usage.completion_tokens


async def run_stream(stub: textgen_pb2_grpc.TextGenerationServiceStub, request: textgen_pb2.GenerateRequest,
                     timeout_s: float, cancel_after: int | None = None,
                     first_message: asyncio.Event | None = None) -> Outcome:
    """Read one stream to its end; with cancel_after, cancel it once that many messages have arrived.

    first_message (optional) is set when the first message arrives.
    """
    outcome = Outcome()
    call = stub.Generate(request, timeout=timeout_s)
    try:
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                break
            _take(outcome, response)
            if first_message is not None:
                first_message.set()
            if cancel_after is not None and outcome.num_messages >= cancel_after:
                call.cancel()
                outcome.code = grpc.StatusCode.CANCELLED
                return outcome
    except grpc.aio.AioRpcError as exc:
        outcome.code, outcome.details, outcome.error = exc.code(), exc.details() or "", exc
    return outcome


def read_sync(stub: textgen_pb2_grpc.TextGenerationServiceStub, request: textgen_pb2.GenerateRequest,
              timeout_s: float) -> Outcome:
    """run_stream for a blocking stub."""
    outcome = Outcome()
    try:
        for response in stub.Generate(request, timeout=timeout_s):
            _take(outcome, response)
    except grpc.RpcError as exc:
        outcome.code, outcome.details, outcome.error = exc.code(), exc.details() or "", exc
    return outcome


async def streams_around(target: str, requests: list[textgen_pb2.GenerateRequest], action, call_timeout_s: float,
                         ended_within_s: float, first_message_timeout_s: float = 60.0) -> list[Outcome]:
    """Start every request; once each stream has its first message, run the blocking action() in a thread; then
    every stream must end within ended_within_s (a call still open then fails the test: a hang, not a deadline).
    """
    async with grpc.aio.insecure_channel(target) as channel:
        stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
        firsts = [asyncio.Event() for _ in requests]
        tasks = [asyncio.create_task(run_stream(stub, request, call_timeout_s, first_message=first))
                 for request, first in zip(requests, firsts)]
        try:
            await asyncio.wait_for(asyncio.gather(*(first.wait() for first in firsts)), first_message_timeout_s)
            await asyncio.to_thread(action)
            return await asyncio.wait_for(asyncio.gather(*tasks), ended_within_s)
        finally:
            for task in tasks:
                task.cancel()

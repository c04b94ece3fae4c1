"""200 streams through both services while clients misbehave: cancels, expired deadlines, killed client processes.

Every well-behaved stream must still get exactly the greedy tokens the same request gets alone, and the engine
must end with nothing running, nothing waiting and no KV block in use (abort frees everything it held).
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass

import grpc
import pytest

from llmserve.textgen.v1 import textgen_pb2_grpc
from tests.faults.stack import greedy_request
from tests.faults.streams import LENGTH, Outcome, read_sync, run_stream
from tests.services.engine_pause import paused
from tests.services.helpers import engine_load, wait_engine_idle
from tests.services.procs import LoggedProcess, poll_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [f"Fault load prompt {i}: the quick brown fox number {i} jumps" for i in range(8)]
NUM_CANCELLED, NUM_DEADLINE, NUM_NORMAL = 20, 10, 164
NUM_CLIENT_PROCESSES, STREAMS_PER_CLIENT = 2, 3  # 194 + 2 * 3 = 200 streams
CONCURRENCY = 32
MAX_TOKENS_CHOICES = (8, 16, 24, 32, 40)
LONG_MAX_TOKENS = 4000  # the streams that are cut: never reached
# Tokens a cut stream may still get from the engine past what its client read (the abort is in flight meanwhile).
# Without the abort each would run to LONG_MAX_TOKENS: several times the total this allows.
ABORT_SLACK_TOKENS = 500
CANCEL_AFTER_MESSAGES = 3
SHORT_DEADLINE_S = 0.5
CALL_TIMEOUT_S = 120.0
LOAD_TIMEOUT_S = 180.0
CLIENT_START_TIMEOUT_S = 120.0


@dataclass(slots=True)
class Planned:
    """One stream of the load: what it asks and how the test treats it."""

    kind: str  # "normal", "cancel" or "deadline"
    prompt: str
    max_tokens: int


def plan() -> list[Planned]:
    rng = random.Random(0)
    kinds = ["cancel"] * NUM_CANCELLED + ["deadline"] * NUM_DEADLINE + ["normal"] * NUM_NORMAL
    rng.shuffle(kinds)
    return [Planned(kind, rng.choice(PROMPTS), LONG_MAX_TOKENS if kind != "normal" else rng.choice(MAX_TOKENS_CHOICES))
            for kind in kinds]


def references(target: str) -> dict[str, list[int]]:
    """Each prompt run alone, to the longest max_tokens; a greedy stream of n tokens is its first n."""
    with grpc.insecure_channel(target) as channel:
        stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
        alone = {prompt: read_sync(stub, greedy_request(prompt, max(MAX_TOKENS_CHOICES)), CALL_TIMEOUT_S)
                 for prompt in PROMPTS}
    for prompt, outcome in alone.items():
        assert outcome.code == grpc.StatusCode.OK and len(outcome.token_ids) == max(MAX_TOKENS_CHOICES), outcome
    return {prompt: outcome.token_ids for prompt, outcome in alone.items()}


async def run_load(target: str, planned: list[Planned]) -> list[Outcome]:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)

        async def one(stream: Planned) -> Outcome:
            async with limit:
                request = greedy_request(stream.prompt, stream.max_tokens)
                if stream.kind == "cancel":
                    return await run_stream(stub, request, CALL_TIMEOUT_S, cancel_after=CANCEL_AFTER_MESSAGES)
                timeout_s = SHORT_DEADLINE_S if stream.kind == "deadline" else CALL_TIMEOUT_S
                return await run_stream(stub, request, timeout_s)

        return await asyncio.gather(*(one(stream) for stream in planned))


def start_clients(target: str) -> list[LoggedProcess]:
    return [LoggedProcess(f"stream-client-{i}", [sys.executable, "-m", "tests.faults.stream_client", target,
                                                 str(STREAMS_PER_CLIENT), str(LONG_MAX_TOKENS)])
            for i in range(NUM_CLIENT_PROCESSES)]


def kill_clients_mid_stream(clients: list[LoggedProcess], core_pid: int) -> None:
    """Once every client stream runs, SIGKILL the clients with the engine core paused: no stream can end first."""
    def all_streaming() -> bool | None:
        for client in clients:
            assert client.proc.poll() is None, f"{client.name} ended early\n{client.log_tail()}"
        counts = [sum(line.startswith("streaming ") for line in client.lines) for client in clients]
        return True if counts == [STREAMS_PER_CLIENT] * len(clients) else None

    poll_until(all_streaming, CLIENT_START_TIMEOUT_S, "every client process to be streaming")
    with paused(core_pid):
        for client in clients:
            client.kill()


async def load_with_killed_clients(stack, planned: list[Planned]) -> list[Outcome]:
    clients = start_clients(stack.tokenizer_target)
    try:
        killer = asyncio.create_task(asyncio.to_thread(kill_clients_mid_stream, clients, stack.engine_core_pid()))
        outcomes = await asyncio.wait_for(run_load(stack.tokenizer_target, planned), LOAD_TIMEOUT_S)
        await asyncio.wait_for(killer, CLIENT_START_TIMEOUT_S)
    finally:
        for client in clients:
            client.kill()
    for client in clients:
        assert client.proc.returncode == -9
        assert not any(line.startswith("finished") for line in client.lines), client.log_tail()
    return outcomes


def check(stream: Planned, outcome: Outcome, reference: list[int]) -> str | None:
    """Why this stream's outcome is wrong, or None."""
    if outcome.contract_violations():
        return f"{outcome.contract_violations()}"
    if stream.kind == "normal":
        if (outcome.code, outcome.finish_reason) != (grpc.StatusCode.OK, LENGTH):
            return f"{outcome.code.name} {outcome.details!r} finish {outcome.finish_reason}"
        return None if outcome.token_ids == reference[:stream.max_tokens] else "tokens differ from the alone run"
    allowed = {"cancel": {grpc.StatusCode.CANCELLED}, "deadline": {grpc.StatusCode.DEADLINE_EXCEEDED}}[stream.kind]
    if outcome.code not in allowed | {grpc.StatusCode.OK}:
        return f"{outcome.code.name} {outcome.details!r}"
    if outcome.code == grpc.StatusCode.OK and len(outcome.token_ids) != stream.max_tokens:
        return f"finished with {len(outcome.token_ids)} tokens"
    num_checked = min(len(outcome.token_ids), len(reference))
    return None if outcome.token_ids[:num_checked] == reference[:num_checked] else "partial tokens differ"


def generated_tokens(stack) -> int:
    with grpc.insecure_channel(stack.engine_target) as channel:
        return engine_load(stack.engine_stub(channel)).num_generated_tokens


def test_misbehaving_clients_leave_every_other_stream_exact_and_the_engine_empty(faults_stack):
    reference = references(faults_stack.tokenizer_target)
    planned = plan()
    generated_before = generated_tokens(faults_stack)
    outcomes = asyncio.run(load_with_killed_clients(faults_stack, planned))
    wrong = [(i, stream.kind, problem) for i, (stream, outcome) in enumerate(zip(planned, outcomes))
             if (problem := check(stream, outcome, reference[stream.prompt])) is not None]
    assert not wrong, wrong[:10]
    codes = [outcome.code for stream, outcome in zip(planned, outcomes) if stream.kind == "cancel"]
    assert codes == [grpc.StatusCode.CANCELLED] * NUM_CANCELLED
    with grpc.insecure_channel(faults_stack.engine_target) as channel:
        load = wait_engine_idle(faults_stack.engine_stub(channel))
    assert (load.num_running, load.num_waiting, load.num_used_blocks) == (0, 0, 0)
    num_cut = NUM_CANCELLED + NUM_DEADLINE + NUM_CLIENT_PROCESSES * STREAMS_PER_CLIENT
    allowed = sum(len(outcome.token_ids) for outcome in outcomes) + num_cut * ABORT_SLACK_TOKENS
    generated = load.num_generated_tokens - generated_before
    assert generated <= allowed, f"{generated} tokens generated: the cut streams were not aborted"

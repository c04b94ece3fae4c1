"""Two engines behind one tokenizer service (`--engine a,b`), one SIGKILLed mid-run: only its streams fail.

Both engine cores are paused while the load is read and the victim killed, so which streams run where is fixed
at that moment: the victim's GetLoad says how many streams must fail, and the survivor's log names (by request
id) every stream that must finish with all its tokens.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from llmserve.engine.v1 import engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2_grpc
from services.engine.serving.engine_process import STATS_ONLY_INTERVAL_S
from tests.faults.stack import (
    ENGINE_SERVICE, START_TIMEOUT_S, TEXTGEN_SERVICE, FaultStack, greedy_request, kill_tree, start_engine,
    start_tokenizer)
from tests.faults.streams import LENGTH, read_sync, streams_around
from tests.services.engine_pause import engine_core_pid, paused
from tests.services.helpers import engine_load, wait_engine_idle
from tests.services.procs import ServiceProcess, poll_until, wait_health

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_STREAMS = 12
LONG_MAX_TOKENS = 1000  # hundreds of steps more than the test takes to pause both cores once every stream runs
CALL_TIMEOUT_S = 300.0
ENDED_WITHIN_S = 60.0
# The engine's line for a finished request: "request finished: request_id=<id>-<suffix> ... finish_reason=length"
# (before the request logs: "[<id>-<suffix>] finished: LENGTH, ...").
FINISHED_LINE = re.compile(r"\b(two-engines-\d+)-[0-9a-f]{12}\b.*finish(?:ed: |_reason=)(?:LENGTH|length)")


class Victim:
    """A second engine, started for this test only, and the tokenizer service that routes over both."""

    def __init__(self, stack: FaultStack):
        self.engine: ServiceProcess = start_engine(stack.model_dir, 0)
        self.tokenizer: ServiceProcess | None = None

    def start_router(self, stack: FaultStack) -> ServiceProcess:
        self.tokenizer = start_tokenizer(stack.model_dir, [stack.engine_target, self.engine.target],
                                         extra=["--routing", "round-robin"])  # both engines get streams
        return self.tokenizer

    def stop(self) -> None:
        for process in (self.tokenizer, self.engine):
            if process is not None:
                process.stop()


@pytest.fixture
def two_engines(faults_stack) -> Iterator[tuple[FaultStack, Victim]]:
    victim = Victim(faults_stack)
    try:
        wait_health(victim.engine.target, ENGINE_SERVICE, timeout_s=START_TIMEOUT_S, process=victim.engine)
        router = victim.start_router(faults_stack)
        wait_health(router.target, TEXTGEN_SERVICE, timeout_s=START_TIMEOUT_S, process=router)
        yield faults_stack, victim
    finally:
        victim.stop()


def requests():
    return [greedy_request(f"Two engines, stream {i}:", LONG_MAX_TOKENS, request_id=f"two-engines-{i}")
            for i in range(NUM_STREAMS)]


def running(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        load = engine_load(engine_pb2_grpc.EngineServiceStub(channel))
    assert load.num_waiting == 0, load
    return load.num_running


def test_one_engine_killed_fails_only_its_own_streams(two_engines):
    stack, victim = two_engines
    survivor_core = stack.engine_core_pid()
    counts = {}

    def kill_victim() -> None:
        # Each engine has two fronts, and GetLoad lands on either. The front holding the streams hears every
        # step; the other hears the core's figures only every STATS_ONLY_INTERVAL_S, so one reading of 12 can
        # come from the first while the second still holds an older figure. Once every stream runs (none can
        # finish meanwhile) the figures stay put: wait out that interval twice so every front has heard them,
        # then read them, final, with both cores paused.
        poll_until(lambda: True if running(stack.engine_target) + running(victim.engine.target) == NUM_STREAMS
                   else None, ENDED_WITHIN_S, "both engines to report every stream running")
        time.sleep(2 * STATS_ONLY_INTERVAL_S)
        with paused(survivor_core):
            os.kill(engine_core_pid(victim.engine.proc.pid), signal.SIGSTOP)  # never resumed: killed below
            counts["survivor"], counts["victim"] = running(stack.engine_target), running(victim.engine.target)
            kill_tree(victim.engine)

    outcomes = asyncio.run(streams_around(victim.tokenizer.target, requests(), kill_victim, CALL_TIMEOUT_S,
                                          ENDED_WITHIN_S))
    assert counts["survivor"] + counts["victim"] == NUM_STREAMS and counts["victim"] > 0, counts
    failed = [o for o in outcomes if o.code != grpc.StatusCode.OK]
    assert [o.code for o in failed] == [grpc.StatusCode.UNAVAILABLE] * counts["victim"], \
        [(o.code.name, o.details) for o in failed]
    completed = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    assert all(not o.contract_violations() and o.finish_reason == LENGTH and len(o.token_ids) == LONG_MAX_TOKENS
               for o in completed), [(o.contract_violations(), len(o.token_ids)) for o in completed]
    finished = {next(iter(o.request_ids)) for o in completed}
    with grpc.insecure_channel(stack.engine_target) as channel:
        wait_engine_idle(engine_pb2_grpc.EngineServiceStub(channel))
    on_survivor = {match[1] for line in stack.engine.lines if (match := FINISHED_LINE.search(line))}
    assert finished == on_survivor
    with grpc.insecure_channel(victim.tokenizer.target) as channel:  # new requests go to the survivor
        stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
        after = [read_sync(stub, greedy_request(f"After the kill {i}", 4), 60) for i in range(4)]
    assert [(o.code, len(o.token_ids)) for o in after] == [(grpc.StatusCode.OK, 4)] * 4, after

"""Gate the real engine instead of the clock: pause its engine-core process (SIGSTOP) while a test acts.

While the core is paused no step runs, so a stream cannot finish and a cancel, deadline or disconnect is
handled by the engine service before the next step. Counting steps from the engine's own counters (GetLoad)
then measures how promptly a request is aborted, however fast or loaded the machine is.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.services.helpers import engine_load, wait_engine_idle
from tests.services.procs import poll_until

# The abort is queued while the core is paused; after it resumes, the step it was in finishes (one token for a
# single running request) and the abort is applied before the next. One more step allows for a core that
# schedules one step ahead. ARCHITECTURE.md §4: blocks are freed "within one step".
MAX_STEPS_AFTER_ABORT = 2
HANDLED_TIMEOUT_S = 30.0


def _descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            children += [int(child) for child in (task / "children").read_text().split()]
    return [pid for child in children for pid in (child, *_descendants(child))]


def _resident_kib(pid: int) -> int:
    with contextlib.suppress(FileNotFoundError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def engine_core_pid(engine_service_pid: int) -> int:
    """The engine-core process under the engine service: the descendant holding the model (most memory)."""
    candidates = _descendants(engine_service_pid)
    assert candidates, "the engine service runs no engine-core process to pause"
    return max(candidates, key=_resident_kib)


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """SIGSTOP the process for the block; SIGCONT it whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_requests_finished(engine_stub: engine_pb2_grpc.EngineServiceStub, num_finished: int) -> engine_pb2.LoadReport:
    """Poll GetLoad until the engine service has ended `num_finished` Generate calls in all (it counts a call
    once its stream is closed, which is after it queued the abort)."""
    def probe() -> engine_pb2.LoadReport | None:
        load = engine_load(engine_stub)
        return load if load.num_finished_requests >= num_finished else None

    return poll_until(probe, HANDLED_TIMEOUT_S, f"the engine service to end Generate call number {num_finished}")


def assert_freed_within_steps(engine_stub: engine_pb2_grpc.EngineServiceStub,
                              at_abort: engine_pb2.LoadReport) -> engine_pb2.LoadReport:
    """Once resumed, the engine frees every block having run at most MAX_STEPS_AFTER_ABORT more steps.

    `at_abort` is GetLoad taken while paused with the abort queued and exactly one request running, so each
    step after it generates exactly one token.
    """
    assert at_abort.num_running == 1 and at_abort.num_used_blocks > 0, at_abort
    after = wait_engine_idle(engine_stub)
    num_steps = after.num_generated_tokens - at_abort.num_generated_tokens
    assert num_steps <= MAX_STEPS_AFTER_ABORT, f"{num_steps} steps ran after the abort was queued"
    return after

"""The fault suite's services: a tiny-model engine on a fixed port and a tokenizer service in front of it.

Both run as real processes on 127.0.0.1 (tests/services/procs.py starts them and ties them to the test
process's life). The engine keeps its port across restarts, so a test can kill it, start it again and find the
same tokenizer service serving again. Only processes started here (and their children) are ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2
from tests.services.engine_pause import engine_core_pid
from tests.services.procs import (
    ENGINE_SERVICE,
    HOST,
    TEXTGEN_SERVICE,
    ServiceProcess,
    free_port,
    poll_until,
    wait_health,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GRACE_S = 30.0  # drains end as soon as the streams do; this only bounds a drain that would not
START_TIMEOUT_S = 180.0
EXIT_TIMEOUT_S = 30.0
MAX_MODEL_LEN = 4096  # room for streams that cannot end by themselves before the test is done with them
DEFAULT_MAX_TOKENS = 16  # the fuzz leaves max_tokens unset often: keep those requests short
# Room for every stream of the load test at its longest, so no sequence is preempted (recomputed) under load:
# greedy outputs are compared exactly, and a recomputed prefill sums in another order than the decode steps.
ENGINE_FRONTS = 2
ENGINE_FLAGS = ["--api-workers", str(ENGINE_FRONTS), "--max-model-len", str(MAX_MODEL_LEN),
                "--num-kvcache-blocks", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
                "--grace-period", str(GRACE_S)]


def start_engine(model_dir: str, port: int) -> ServiceProcess:
    return ServiceProcess("engine", ["--model", model_dir, *ENGINE_FLAGS], port)


def start_tokenizer(model_dir: str, engine_targets: list[str], port: int = 0,
                    extra: list[str] | None = None) -> ServiceProcess:
    return ServiceProcess("tokenizer", ["--engine", ",".join(engine_targets), "--model", model_dir, "--workers", "1",
                                        "--default-max-tokens", str(DEFAULT_MAX_TOKENS),
                                        "--grace-period", str(GRACE_S), *(extra or [])], port)


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid (children of every thread, recursively)."""
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                for child in (task / "children").read_text().split():
                    found += [int(child), *descendants(int(child))]
    return found


def alive(pid: int) -> bool:
    """Running (not a zombie, not gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[-1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = EXIT_TIMEOUT_S) -> None:
    poll_until(lambda: True if not any(alive(pid) for pid in pids) else None, timeout_s,
               f"processes {pids} to be gone")


@contextlib.contextmanager
def ending(process: ServiceProcess) -> Iterator[ServiceProcess]:
    """For a test that signals or kills `process`: it is gone when the block ends, even if the test failed
    half-way, so the next test's `ensure_up` starts a fresh one instead of finding it dying."""
    try:
        yield process
    finally:
        process.stop()


def kill_tree(process: ServiceProcess) -> list[int]:
    """SIGKILL a service and every process under it (as a node failure or the OOM killer would)."""
    pids = [process.proc.pid, *descendants(process.proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.proc.wait(EXIT_TIMEOUT_S)
    wait_gone(pids)
    return pids


class FaultStack:
    """One engine (fixed port, restartable) behind one tokenizer service (port 0, restartable)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.engine_port = free_port()
        self.engine_target = f"{HOST}:{self.engine_port}"
        self.engine = start_engine(model_dir, self.engine_port)
        self.tokenizer = start_tokenizer(model_dir, [self.engine_target])  # starts while the engine loads

    @property
    def tokenizer_target(self) -> str:
        return self.tokenizer.target

    def engine_core_pid(self) -> int:
        return engine_core_pid(self.engine.proc.pid)

    def wait_ready(self) -> None:
        assert self.engine.wait_port(START_TIMEOUT_S) == self.engine_port
        wait_health(self.engine_target, ENGINE_SERVICE, timeout_s=START_TIMEOUT_S, process=self.engine)
        wait_health(self.tokenizer_target, TEXTGEN_SERVICE, timeout_s=START_TIMEOUT_S, process=self.tokenizer)

    def ensure_up(self) -> None:
        """Restart whichever service a previous test ended, then wait until both report SERVING."""
        if self.engine.proc.poll() is not None:
            self.engine.stop()
            self.engine = start_engine(self.model_dir, self.engine_port)
        if self.tokenizer.proc.poll() is not None:
            self.tokenizer.stop()
            self.tokenizer = start_tokenizer(self.model_dir, [self.engine_target])
        self.wait_ready()

    def kill_engine_service(self) -> list[int]:
        return kill_tree(self.engine)

    def stop(self) -> None:
        """SIGTERM both at once (each drains on its own), then wait for each."""
        for process in (self.tokenizer, self.engine):
            if process.proc.poll() is None:
                process.proc.send_signal(signal.SIGTERM)
        for process in (self.tokenizer, self.engine):
            process.stop()

    def engine_stub(self, channel: grpc.Channel) -> engine_pb2_grpc.EngineServiceStub:
        return engine_pb2_grpc.EngineServiceStub(channel)


def greedy_request(prompt: str, max_tokens: int, request_id: str = "") -> textgen_pb2.GenerateRequest:
    """A deterministic request: greedy, EOS ignored, so it yields exactly max_tokens ids."""
    return textgen_pb2.GenerateRequest(request_id=request_id, text=prompt, sampling=common_pb2.SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=max_tokens))

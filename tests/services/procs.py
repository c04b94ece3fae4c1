"""Service subprocesses for the end-to-end tests: start, read the bound port, wait for health, stop.

Every wait is bounded by a deadline; every poll loop by a count as well. Children get SIGKILL when the
test process dies (PR_SET_PDEATHSIG), so a killed test run leaves no engine behind on a shared machine.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
ENGINE_SERVICE = "llmserve.engine.v1.EngineService"
TEXTGEN_SERVICE = "llmserve.textgen.v1.TextGenerationService"
SMALL_ENGINE_FLAGS = ["--max-model-len", "1024", "--num-kvcache-blocks", "256", "--max-num-seqs", "32",
                      "--max-num-batched-tokens", "1024", "--grace-period", "1"]
MODEL_LOAD_TIMEOUT_S = 240.0
LISTENING = re.compile(r"^llmserve-(?P<name>\w+) listening on (?P<host>[\w.:\[\]]+):(?P<port>\d+)\b")
# The text log line of freeze_startup_heap (services/common/gc_heap.py): its process id.
HEAP_FROZEN = re.compile(r" INFO (\d+) services\.common\.gc_heap .* start-up heap frozen: \d+ objects")
POLL_INTERVAL_S = 0.05
MAX_LOG_LINES = 100_000

T = TypeVar("T")


def child_env() -> dict[str, str]:
    """The test environment plus import paths, offline switches and one torch thread for a child Python.

    One thread: on two shared cores a second OpenMP thread makes torch many times slower whenever anything
    else runs, and the offline reference in the test process runs on one thread too (same summation order).
    """
    env = dict(os.environ)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "clients" / "python")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", LLMSERVE_LOG_LEVEL="INFO", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


# Sets PR_SET_PDEATHSIG (kept across exec) and then becomes the real command. A preexec_fn would do the same
# but makes subprocess fork() instead of vfork(), and gRPC's fork handlers then crash the child.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, 9)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def free_port() -> int:
    """A port that was free a moment ago (for a service that must come back on the same port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def poll_until(probe: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = POLL_INTERVAL_S) -> T:
    """Call probe() until it returns something other than None; AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    max_polls = int(timeout_s / interval_s) + 2
    for _ in range(max_polls):
        result = probe()
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            break
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class LoggedProcess:
    """A child process whose merged stdout/stderr a reader thread keeps (lines) and hands out (queue)."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.argv = argv
        self.lines: list[str] = []
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.proc = subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, *argv], cwd=REPO_ROOT, env=child_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, name=f"{name}-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def logged_pids(self, pattern: re.Pattern[str]) -> set[int]:
        """The process ids (group 1) of the lines matching `pattern`: this process and its children log here."""
        return {int(match[1]) for line in list(self.lines) if (match := pattern.search(line))}

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.lines[-num_lines:])

    def wait_line(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """The first not yet consumed output line matching pattern; fails on timeout or exit."""
        deadline = time.monotonic() + timeout_s
        for _ in range(MAX_LOG_LINES):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{self.name}: no line matching {pattern.pattern!r} within {timeout_s:.0f}s\n"
                                     f"{self.log_tail()}")
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"{self.name} exited (rc={self.proc.wait(5)}) before printing "
                                     f"{pattern.pattern!r}\n{self.log_tail()}")
            match = pattern.search(line)
            if match:
                return match
        raise AssertionError(f"{self.name}: no line matching {pattern.pattern!r} in {MAX_LOG_LINES} lines")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._reader.join(timeout_s)

    def kill(self, timeout_s: float = 15.0) -> None:
        self.proc.kill()
        self.proc.wait(timeout_s)


class ServiceProcess(LoggedProcess):
    """`python -m services.<name> --host 127.0.0.1 --port P ...`; `port` is read from its listening line."""

    def __init__(self, name: str, args: list[str], port: int = 0):
        super().__init__(name, [sys.executable, "-m", f"services.{name}", "--host", HOST, "--port", str(port), *args])
        self._port: int | None = None

    def wait_port(self, timeout_s: float = MODEL_LOAD_TIMEOUT_S) -> int:
        if self._port is None:
            match = self.wait_line(LISTENING, timeout_s)
            assert match["name"] == self.name and match["host"] == HOST, match.group(0)
            self._port = int(match["port"])
            assert self._port > 0
        return self._port

    @property
    def target(self) -> str:
        return f"{HOST}:{self.wait_port()}"


def health_status(target: str, service: str, timeout_s: float = 2.0) -> int | None:
    """The grpc.health.v1 status of `service` at target, or None when the server does not answer."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout_s)
        except grpc.RpcError:
            return None
    return reply.status


def wait_health(target: str, service: str, status: int = health_pb2.HealthCheckResponse.SERVING,
                timeout_s: float = MODEL_LOAD_TIMEOUT_S, process: LoggedProcess | None = None) -> None:
    """Poll Check(service) until it reports `status`; fails early when `process` exits."""

    def probe() -> bool | None:
        if process is not None and process.proc.poll() is not None:
            raise AssertionError(f"{process.name} exited (rc={process.proc.returncode})\n{process.log_tail()}")
        return True if health_status(target, service) == status else None

    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    poll_until(probe, timeout_s, f"{service or '(server)'} at {target} to be {name}", interval_s=0.1)


SERVING_LINE = re.compile(r"process (\d+) serving")


def wait_all_serving(process: LoggedProcess, num_processes: int, timeout_s: float = MODEL_LOAD_TIMEOUT_S) -> None:
    """Wait until `num_processes` distinct processes of a service logged that they serve (each worker of a
    shared port logs its own health flips), so no later connection can land on a worker still booting."""

    def probe() -> bool | None:
        return True if len(process.logged_pids(SERVING_LINE)) >= num_processes else None

    poll_until(probe, timeout_s, f"{num_processes} {process.name} processes to serve", interval_s=0.1)


def start_engine(port: int = 0, extra: list[str] | None = None) -> ServiceProcess:
    return ServiceProcess("engine", SMALL_ENGINE_FLAGS + (extra or []), port)


def start_tokenizer(engine_target: str) -> ServiceProcess:
    return ServiceProcess("tokenizer", ["--engine", engine_target, "--grace-period", "1"])

"""Several processes serving one port (SO_REUSEPORT), as in gRPC's multiprocessing example.

A gRPC front written in Python relays at most what one interpreter lock allows; N copies of it on one
port relay N times as much. The kernel spreads incoming connections over the listening sockets that
share the port, so each client connection (a channel, with all its calls) lands on one process. Each
process is a full server: its own health, its own draining, its own connections upstream.

Usage in a service's entry point (the parent process serves too; it is worker 0):

    with reserve_port(args.host, args.port) as port, \\
            WorkerGroup(serve_worker, args, port, args.workers - 1) as workers:
        asyncio.run(serve(args, port, workers))    # its server built with reuse_port=True, and
                                                   # run_until_signalled(..., workers=workers)
    exit_after_drain(workers.exit_code)         # flushes, then skips the interpreter's slow native teardown

- `reserve_port(host, port)` binds (without listening) a SO_REUSEPORT socket and yields the concrete port
  (port 0 becomes a free one), so every process binds the same port and no other program takes it
  meanwhile. Each grpc.aio server must set ("grpc.so_reuseport", 1) (build_server(reuse_port=True)).
- `WorkerGroup(entry, args, port, num_workers)` starts `num_workers` processes (multiprocessing's spawn
  context: a fresh interpreter, safe with gRPC's threads) that each call `entry(args, port)`; `entry` is
  a top-level (picklable) function that serves until SIGTERM, e.g. `asyncio.run(serve(args, port))`.
  In the workers SIGINT is ignored (so run_until_signalled(handle_sigint=False) there) (a terminal's Ctrl-C reaches the whole process group; the parent turns
  it into one SIGTERM per worker) and the kernel sends SIGTERM when the parent dies (PR_SET_PDEATHSIG).
- `await workers.wait_exit()` returns when a worker exits; before `stop()` that is unexpected and
  `exit_code` becomes 1, so the parent can drain and exit non-zero for its supervisor to act.
- `workers.stop()` sends SIGTERM to the living workers (idempotent); `join(timeout_s)` waits for them and
  SIGKILLs the ones still there after timeout_s. Leaving the `with` block does both.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
KILL_WAIT_S = 5.0


@contextlib.contextmanager
def reserve_port(host: str, port: int) -> Iterator[int]:
    """Hold `host:port` with a bound, non-listening SO_REUSEPORT socket; yield the concrete port number."""
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        yield sock.getsockname()[1]
    finally:
        sock.close()


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _worker_main(entry: Callable[..., None], args: Any, port: int, parent_pid: int, extra: tuple) -> None:
    """A worker process: die with the parent, leave Ctrl-C to the parent, then serve."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Until the server installs its own handler (it loads its tokenizer or model first), SIGTERM means a clean exit.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked by start(), see there
    entry(args, port, *extra)


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


class WorkerGroup:
    """The extra processes of a front that serves one port from several processes (see the module docstring)."""

    def __init__(self, entry: Callable[..., None], args: Any, port: int, num_workers: int,
                 name: str = "worker", extra_args: list[tuple] | None = None):
        """`extra_args[i]`, when given, is passed to worker i + 1 after (args, port), e.g. its own connection."""
        self._entry = entry
        self._args = args
        self._port = port
        self._name = name
        self._num_workers = num_workers
        self._extra_args = extra_args or [()] * num_workers
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.stopping = False
        self.failed = False

    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
        self.join()

    @property
    def exit_code(self) -> int:
        """1 when a worker exited before stop() or with a non-zero status after it, else 0."""
        return 1 if self.failed else 0

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        for index in range(1, self._num_workers + 1):
            process = context.Process(target=_worker_main, name=f"{self._name}-{index}",
                                      args=(self._entry, self._args, self._port, os.getpid(),
                                            self._extra_args[index - 1]))
            # NOTE: the child starts with stop signals blocked (the mask survives exec) until _worker_main has
            # its handler in place: a drain that begins while it is still importing must not kill it (-15).
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            try:
                process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            self.processes.append(process)
        if self.processes:
            logger.info("started %d %s processes on port %d: pids %s", len(self.processes), self._name, self._port,
                        [p.pid for p in self.processes])

    async def wait_exit(self) -> None:
        """Return once any worker has exited (never, without workers); marks the group failed before stop()."""
        if not self.processes:
            await asyncio.Event().wait()
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        sentinels = [p.sentinel for p in self.processes]

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        for sentinel in sentinels:
            loop.add_reader(sentinel, on_exit)
        try:
            await exited
        finally:
            for sentinel in sentinels:
                loop.remove_reader(sentinel)
        if not self.stopping:
            self.failed = True
            ready = multiprocessing.connection.wait([p.sentinel for p in self.processes], timeout=0)
            for process in self.processes:
                if process.sentinel in ready:
                    process.join(KILL_WAIT_S)  # its sentinel closed: it is exiting; reap it to read its code
            gone = [(p.name, p.exitcode) for p in self.processes if p.sentinel in ready]
            logger.error("worker process exited unexpectedly (name, exit code): %s", gone)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Ask every living worker to drain and exit."""
        self.stopping = True
        for process in self.processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, sig)

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for every worker; SIGKILL those still alive after timeout_s. Records non-zero exits as failures."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.error("%s (pid %d) did not exit within %.0fs; killing it", process.name, process.pid, timeout_s)
                process.kill()
                process.join(KILL_WAIT_S)
            if process.exitcode != 0:
                self.failed = True


def exit_after_drain(code: int):
    """End a service process whose drain is over: flush logs and output, then exit without the interpreter's teardown.

    NOTE: that teardown runs native destructors (gRPC, tokenizers, torch) with no Python frame for seconds
    (measured: 0.4 s for an engine front, 6-8 s for a tokenizer relay on the shared CPU machine), so a
    supervisor would see the exit that long after the last stream ended. Nothing is left to clean by then.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

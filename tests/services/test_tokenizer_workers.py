"""`llmserve-tokenizer --workers 2`: two processes on one port, each a full relay; drained and stopped as one.

Which process serves a connection is read from /proc: the server-side socket of each established
connection belongs to exactly one of the processes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.common.v1 import common_pb2
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from tests.services.procs import (
    HEAP_FROZEN, LISTENING, TEXTGEN_SERVICE, ServiceProcess, poll_until, wait_all_serving, wait_health)

pytestmark = pytest.mark.slow

NUM_CONNECTIONS = 16  # all on one of two processes by chance: 2 ** -15
PROMPT = "The capital of France is"
EXIT_TIMEOUT_S = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # else channels to one target share a connection


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """The default model's tokenizer saved as tokenizer.json: same fingerprint, loads in a fraction of the time."""
    from services.tokenizer.tokenizer import TextTokenizer

    path = tmp_path_factory.mktemp("default-tokenizer")
    TextTokenizer.load(None).hf_tokenizer.save_pretrained(str(path))
    return str(path)


def start_workers(engine_target: str, model: str, num_workers: int = 2, grace_s: float = 30.0) -> ServiceProcess:
    return ServiceProcess("tokenizer", ["--engine", engine_target, "--model", model, "--workers", str(num_workers),
                                        "--grace-period", str(grace_s)])


@pytest.fixture
def workers(stack, tokenizer_dir) -> Iterator[ServiceProcess]:
    process = start_workers(stack.engine_target, tokenizer_dir)
    try:
        wait_listening(process, 2)
        wait_health(process.target, TEXTGEN_SERVICE, process=process)
        wait_all_serving(process, 2)  # each worker serving (health, drain) before the tests count on it
        yield process
    finally:
        process.stop()


def child_pids(pid: int) -> list[int]:
    """Direct children (multiprocessing's resource tracker included)."""
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = fd.readlink().name
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[len("socket:["):-1]))
    return inodes


def _tcp_inodes(port: int, state: str) -> set[int]:
    """Inodes of the TCP sockets whose local port is `port`, in `state` (0A listen, 01 established)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
                inodes.add(int(fields[9]))
    return inodes


def pids_with(port: int, state: str, pids: list[int]) -> dict[int, int]:
    """How many sockets on `port` in `state` each pid holds."""
    wanted = _tcp_inodes(port, state)
    return {pid: len(_socket_inodes(pid) & wanted) for pid in pids}


def server_pids(process: ServiceProcess) -> list[int]:
    """The parent and its worker processes (the children that listen on the port)."""
    port = process.wait_port()
    listening = pids_with(port, "0A", [process.proc.pid, *child_pids(process.proc.pid)])
    return [pid for pid, count in listening.items() if count]


def wait_listening(process: ServiceProcess, num_processes: int) -> list[int]:
    return poll_until(lambda: server_pids(process) if len(server_pids(process)) == num_processes else None,
                      120, f"{num_processes} processes listening")


def assert_all_exit(pids: list[int]) -> None:
    """Every process in `pids` is gone (multiprocessing's resource tracker leaves just after its parent)."""
    poll_until(lambda: True if not [pid for pid in pids if Path(f"/proc/{pid}").exists()] else None,
               EXIT_TIMEOUT_S, f"processes {pids} to exit")


def greedy_request(max_tokens: int) -> textgen_pb2.GenerateRequest:
    request = textgen_pb2.GenerateRequest(text=PROMPT)
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    request.sampling.max_tokens = max_tokens
    return request


def generate(channel: grpc.Channel, max_tokens: int) -> tuple[str, list[int], int]:
    """(text, token ids, finish reason) of one greedy stream."""
    stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
    text, ids, finish = "", [], common_pb2.FINISH_REASON_UNSPECIFIED
    for response in stub.Generate(greedy_request(max_tokens), timeout=120):
        text, ids, finish = text + response.text, ids + list(response.token_ids), response.finish_reason
    return text, ids, finish


def test_every_worker_serves_generate_and_health(stack, workers):
    assert sum(bool(LISTENING.search(line)) for line in workers.lines) == 1
    pids = server_pids(workers)
    poll_until(lambda: True if workers.logged_pids(HEAP_FROZEN) == set(pids) else None, 60,
               f"the start-up heap frozen in {pids}")
    with grpc.insecure_channel(stack.tokenizer_target) as single:
        expected = generate(single, 8)
    channels = [grpc.insecure_channel(workers.target, options=OWN_CONNECTION) for _ in range(NUM_CONNECTIONS)]
    try:
        for channel in channels:
            assert generate(channel, 8) == expected
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=TEXTGEN_SERVICE), timeout=10)
            assert reply.status == SERVING
        connections = pids_with(workers.wait_port(), "01", pids)
        assert sum(connections.values()) == NUM_CONNECTIONS and all(connections.values()), connections
    finally:
        for channel in channels:
            channel.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_drains_every_worker_and_leaves_no_process(workers, sig):
    pids = server_pids(workers)
    children = child_pids(workers.proc.pid)
    channels = [grpc.insecure_channel(workers.target, options=OWN_CONNECTION) for _ in range(NUM_CONNECTIONS)]
    stub_calls = [textgen_pb2_grpc.TextGenerationServiceStub(channel).Generate(greedy_request(12), timeout=120)
                  for channel in channels]
    try:
        firsts = [next(call) for call in stub_calls]  # every stream is in flight
        assert all(first.token_ids for first in firsts)
        assert all(pids_with(workers.wait_port(), "01", pids).values())
        workers.proc.send_signal(sig)
        for first, call in zip(firsts, stub_calls):
            ids = list(first.token_ids)
            for response in call:
                ids += response.token_ids
            assert len(ids) == 12 and response.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert workers.proc.wait(EXIT_TIMEOUT_S) == 0, workers.log_tail()
    finally:
        for channel in channels:
            channel.close()
    assert_all_exit(children)


def test_a_worker_that_dies_stops_the_service_with_an_error(stack, tokenizer_dir):
    process = start_workers(stack.engine_target, tokenizer_dir, grace_s=1.0)
    try:
        pids = wait_listening(process, 2)
        children = child_pids(process.proc.pid)
        worker = next(pid for pid in pids if pid != process.proc.pid)
        os.kill(worker, signal.SIGKILL)  # as the out-of-memory killer does
        assert process.proc.wait(EXIT_TIMEOUT_S) == 1, process.log_tail()
        assert "exited unexpectedly" in process.log_tail()
        assert_all_exit(children)
    finally:
        process.stop()


def test_one_worker_does_not_share_its_port(stack, tokenizer_dir):
    first = start_workers(stack.engine_target, tokenizer_dir, num_workers=1, grace_s=1.0)
    try:
        second = ServiceProcess("tokenizer", ["--engine", stack.engine_target, "--model", tokenizer_dir,
                                              "--workers", "1"], port=first.wait_port())
        assert second.proc.wait(EXIT_TIMEOUT_S) != 0
        assert not any(LISTENING.search(line) for line in second.lines)
        assert first.proc.poll() is None
    finally:
        first.stop()

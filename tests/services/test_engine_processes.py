"""The engine service's processes, for real: two API fronts on one port, the core killed, a drain under load.

A tiny random-weight checkpoint keeps start-up short; each test starts its own engine (port 0) because
each ends it. Every call carries a deadline, so a hang fails the test instead of stalling the run.
"""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from grpc_health.v1 import health_pb2

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.services.helpers import wait_engine_idle
from tests.services.procs import ENGINE_SERVICE, HEAP_FROZEN, ServiceProcess, health_status, poll_until, wait_health

CALL_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 60.0
NUM_STREAMS = 8
SERVING = health_pb2.HealthCheckResponse.SERVING
CORE_PID = re.compile(r"engine core process: pid (\d+)")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return str(directory)


def start_tiny_engine(checkpoint: str, api_workers: int, grace_s: float = 30.0) -> ServiceProcess:
    engine = ServiceProcess("engine", ["--model", checkpoint, "--api-workers", str(api_workers),
                                       "--max-model-len", "4096", "--num-kvcache-blocks", "1024",
                                       "--max-num-seqs", "32", "--grace-period", str(grace_s)])
    wait_health(engine.target, ENGINE_SERVICE, process=engine)
    return engine


def core_pid(engine: ServiceProcess) -> int:
    return int(next(m[1] for line in engine.lines if (m := CORE_PID.search(line))))


def children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as file:
        return {int(child) for child in file.read().split()}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def request(request_id: str, max_tokens: int, first_id: int = 10) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=list(range(first_id, first_id + 8)),
                                      sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                         ignore_eos=True))


class Streams:
    """NUM_STREAMS Generate calls, each on its own channel (so SO_REUSEPORT spreads them over the fronts)."""

    def __init__(self, target: str, max_tokens: int):
        self.channels = [grpc.insecure_channel(target) for _ in range(NUM_STREAMS)]
        self.calls = [engine_pb2_grpc.EngineServiceStub(channel).Generate(request(f"s{i}", max_tokens, 10 + i),
                                                                           timeout=CALL_TIMEOUT_S)
                      for i, channel in enumerate(self.channels)]
        self.firsts = [next(call) for call in self.calls]  # every stream is running

    def finish(self) -> list[tuple[grpc.StatusCode, list[int], int]]:
        """(status, token ids, finish reason) per stream, reading each to its end."""
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            return list(pool.map(self._drain, range(NUM_STREAMS)))

    def _drain(self, index: int):
        ids, reason = list(self.firsts[index].token_ids), self.firsts[index].finish_reason
        try:
            for response in self.calls[index]:
                ids += response.token_ids
                reason = response.finish_reason
        except grpc.RpcError as exc:
            return exc.code(), ids, reason
        return grpc.StatusCode.OK, ids, reason

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def test_two_fronts_serve_one_port_and_abort_each_others_streams(tiny_checkpoint):
    engine = start_tiny_engine(tiny_checkpoint, api_workers=2)
    try:
        front_pids = children(engine.proc.pid) - {core_pid(engine)}
        assert len([pid for pid in front_pids if alive(pid)]) >= 1, "no second front process"
        # every process of the service leaves its start-up heap out of the collector's scans: both fronts, the core
        frozen = poll_until(lambda: pids if len(pids := engine.logged_pids(HEAP_FROZEN)) == 3 else None,
                            60, "three processes to freeze their start-up heap")
        assert {engine.proc.pid, core_pid(engine)} < frozen and frozen <= {engine.proc.pid} | children(engine.proc.pid)
        streams = Streams(engine.target, max_tokens=3000)
        with grpc.insecure_channel(engine.target) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            ids = [f"s{i}" for i in range(NUM_STREAMS)]
            aborted = stub.Abort(engine_pb2.AbortRequest(request_ids=ids + ["unknown"]), timeout=30)
            assert sorted(aborted.aborted_request_ids) == ids
            results = streams.finish()
            assert [(code, reason) for code, _, reason in results] == \
                [(grpc.StatusCode.OK, common_pb2.FINISH_REASON_ABORTED)] * NUM_STREAMS
            wait_engine_idle(stub)
            finished = Streams(engine.target, max_tokens=5).finish()
            assert [(code, len(tokens), reason) for code, tokens, reason in finished] == \
                [(grpc.StatusCode.OK, 5, common_pb2.FINISH_REASON_LENGTH)] * NUM_STREAMS
        streams.close()
    finally:
        engine.stop()


def test_a_killed_core_ends_every_stream_unavailable_and_the_service_exits_non_zero(tiny_checkpoint):
    engine = start_tiny_engine(tiny_checkpoint, api_workers=2)
    try:
        pids = children(engine.proc.pid)
        streams = Streams(engine.target, max_tokens=4000)
        os.kill(core_pid(engine), signal.SIGKILL)
        results = streams.finish()
        assert [code for code, _, _ in results] == [grpc.StatusCode.UNAVAILABLE] * NUM_STREAMS
        assert engine.proc.wait(EXIT_TIMEOUT_S) != 0
        poll_until(lambda: True if not any(alive(pid) for pid in pids) else None, EXIT_TIMEOUT_S,
                   "every process of the service to be gone")
        streams.close()
    finally:
        engine.kill()


def test_sigterm_lets_every_stream_finish_refuses_new_ones_and_exits_zero(tiny_checkpoint):
    engine = start_tiny_engine(tiny_checkpoint, api_workers=2)
    try:
        streams = Streams(engine.target, max_tokens=2000)
        engine.proc.send_signal(signal.SIGTERM)
        poll_until(lambda: True if health_status(engine.target, ENGINE_SERVICE) != SERVING else None, 30,
                   "health to stop saying SERVING")
        with grpc.insecure_channel(engine.target) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(engine_pb2_grpc.EngineServiceStub(channel).Generate(request("late", 4), timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        results = streams.finish()
        assert [(code, len(tokens), reason) for code, tokens, reason in results] == \
            [(grpc.StatusCode.OK, 2000, common_pb2.FINISH_REASON_LENGTH)] * NUM_STREAMS
        assert engine.proc.wait(EXIT_TIMEOUT_S) == 0
        streams.close()
    finally:
        engine.kill()

"""A SIGTERM drain, for real, on both services (each with two processes on its port): until the last in-flight
stream ends, health answers NOT_SERVING on existing and new connections and Generate is refused with
UNAVAILABLE (not "connection refused"); then the service exits 0 at once, long before its grace period.

The stream is held in flight by pausing the engine-core process (SIGSTOP), not by timing.
"""

from __future__ import annotations

import queue
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from tests.services.engine_pause import paused
from tests.services.procs import (
    ENGINE_SERVICE,
    TEXTGEN_SERVICE,
    ServiceProcess,
    poll_until,
    wait_all_serving,
    wait_health,
)
from tests.services.test_engine_processes import core_pid

pytestmark = pytest.mark.slow

GRACE_S = 300.0  # far longer than the test: an exit within EXIT_TIMEOUT_S shows the drain did not wait for it
EXIT_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 120.0
NUM_TOKENS = 12
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NEW_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """bench/tiny_model.py's checkpoint: the default tokenizer on a near-zero-compute Llama."""
    from bench.tiny_model import write_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-with-tokenizer"))
    write_tiny_model(path)
    return path


def start_engine(model: str) -> ServiceProcess:
    engine = ServiceProcess("engine", ["--model", model, "--api-workers", "2", "--max-model-len", "512",
                                       "--num-kvcache-blocks", "256", "--grace-period", str(GRACE_S)])
    wait_health(engine.target, ENGINE_SERVICE, process=engine)
    return engine


def health(channel: grpc.Channel, service: str) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=5).status
    except grpc.RpcError:
        return None


def assert_draining(process: ServiceProcess, existing: grpc.Channel, service: str, refuse_new) -> None:
    """While a stream is held in flight: NOT_SERVING on the stream's connection and on new ones; new work refused."""
    poll_until(lambda: True if health(existing, service) == NOT_SERVING else None, 30,
               f"{service} to answer NOT_SERVING on an existing connection")
    for _ in range(4):
        with grpc.insecure_channel(process.target, options=NEW_CONNECTION) as fresh:
            poll_until(lambda: True if health(fresh, service) == NOT_SERVING else None, 30,
                       f"{service} to answer NOT_SERVING on a new connection")
    with pytest.raises(grpc.RpcError) as refused:
        refuse_new()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    assert process.proc.poll() is None, "exited with a stream in flight"


def greedy_request(request_id: str) -> engine_pb2.GenerateRequest:
    """A short greedy request of NUM_TOKENS tokens for the engine."""
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[10, 11, 12],
                                      sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                                                         ignore_eos=True))


def test_engine_drain_answers_until_its_last_stream_ends_then_exits_zero(tiny_dir):
    engine = start_engine(tiny_dir)
    try:
        with grpc.insecure_channel(engine.target) as existing:
            stub = engine_pb2_grpc.EngineServiceStub(existing)
            call = stub.Generate(greedy_request("in-flight"), timeout=CALL_TIMEOUT_S)
            token_ids = list(next(call).token_ids)
            with paused(core_pid(engine)):
                engine.proc.send_signal(signal.SIGTERM)
                assert_draining(engine, existing, ENGINE_SERVICE,
                                lambda: list(stub.Generate(greedy_request("late"), timeout=CALL_TIMEOUT_S)))
            for response in call:
                token_ids += response.token_ids
            assert len(token_ids) == NUM_TOKENS and response.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert engine.proc.wait(EXIT_TIMEOUT_S) == 0, engine.log_tail()
    finally:
        engine.kill()


def test_engine_drain_ends_a_batch_stream_once_its_requests_have_and_refuses_new_ones_on_it(tiny_dir):
    engine = start_engine(tiny_dir)
    try:
        with grpc.insecure_channel(engine.target) as existing:
            stub = engine_pb2_grpc.EngineServiceStub(existing)

            def message(request_id: str) -> engine_pb2.GenerateBatchRequest:
                return engine_pb2.GenerateBatchRequest(requests=[greedy_request(request_id)])

            outbox: queue.SimpleQueue = queue.SimpleQueue()
            outbox.put(message("in-flight"))
            call = stub.GenerateBatch(iter(outbox.get, None), timeout=CALL_TIMEOUT_S)  # never half-closed
            token_ids = list(next(call).responses[0].token_ids)
            with paused(core_pid(engine)):
                engine.proc.send_signal(signal.SIGTERM)
                assert_draining(engine, existing, ENGINE_SERVICE,
                                lambda: list(stub.Generate(message("late").requests[0], timeout=CALL_TIMEOUT_S)))
                outbox.put(message("late-on-the-stream"))
                responses, refused = [], []
                while not refused:  # tokens of steps run before the pause may come first
                    later = next(call)
                    responses += later.responses
                    refused = [(e.request_id, e.status.code) for e in later.errors]
            assert refused == [("late-on-the-stream", grpc.StatusCode.UNAVAILABLE.value[0])]
            responses += [r for later in call for r in later.responses]  # ends by itself, status OK
            assert call.code() == grpc.StatusCode.OK
            token_ids += [i for response in responses for i in response.token_ids]
            assert len(token_ids) == NUM_TOKENS and responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert engine.proc.wait(EXIT_TIMEOUT_S) == 0, engine.log_tail()
    finally:
        engine.kill()


def test_tokenizer_drain_answers_until_its_last_stream_ends_then_exits_zero(tiny_dir):
    engine = start_engine(tiny_dir)
    tokenizer = ServiceProcess("tokenizer", ["--engine", engine.target, "--model", tiny_dir, "--workers", "2",
                                             "--grace-period", str(GRACE_S)])
    try:
        wait_health(tokenizer.target, TEXTGEN_SERVICE, process=tokenizer)
        wait_all_serving(tokenizer, 2)  # the first call may land on either worker: both must be ready
        with grpc.insecure_channel(tokenizer.target) as existing:
            stub = textgen_pb2_grpc.TextGenerationServiceStub(existing)
            request = textgen_pb2.GenerateRequest(token_ids={"ids": [10, 11, 12]}, sampling=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True))
            call = stub.Generate(request, timeout=CALL_TIMEOUT_S)
            token_ids = list(next(call).token_ids)
            with paused(core_pid(engine)):
                tokenizer.proc.send_signal(signal.SIGTERM)
                assert_draining(tokenizer, existing, TEXTGEN_SERVICE,
                                lambda: list(stub.Generate(request, timeout=CALL_TIMEOUT_S)))
            for response in call:
                token_ids += response.token_ids
            assert len(token_ids) == NUM_TOKENS and response.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert tokenizer.proc.wait(EXIT_TIMEOUT_S) == 0, tokenizer.log_tail()
    finally:
        tokenizer.kill()
        engine.stop()

"""Two real engine services behind one tokenizer service (`--routing prefix`, the tiny checkpoint of
bench/tiny_model.py): a request goes to the replica whose prefix cache holds its prompt's prefix, as the
engines' SubscribeKvEvents streams report it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import pytest

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from tests.services.procs import ENGINE_SERVICE, TEXTGEN_SERVICE, ServiceProcess, start_engine, wait_health

pytestmark = pytest.mark.slow

PREFIX_LEN = 64  # four 16-token blocks
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from bench.tiny_model import write_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-llama"))
    write_tiny_model(path)
    return path


@pytest.fixture
def engines(tiny_model) -> Iterator[list[ServiceProcess]]:
    started = [start_engine(extra=["--model", tiny_model]) for _ in range(2)]
    try:
        for engine in started:
            wait_health(engine.target, ENGINE_SERVICE, process=engine)
        yield sorted(started, key=lambda engine: engine.target)  # the router's candidate order
    finally:
        for engine in started:
            engine.stop()


def prefix(first_id: int) -> list[int]:
    return [first_id, *range(1000, 1000 + PREFIX_LEN - 1)]


def generate_direct(engine: ServiceProcess, prompt_ids: list[int]) -> None:
    with grpc.insecure_channel(engine.target) as channel:
        request = engine_pb2.GenerateRequest(request_id=f"direct-{prompt_ids[0]}", prompt_token_ids=prompt_ids,
                                             sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True))
        assert list(engine_pb2_grpc.EngineServiceStub(channel).Generate(request, timeout=TIMEOUT_S))


def load(engine: ServiceProcess) -> engine_pb2.LoadReport:
    with grpc.insecure_channel(engine.target) as channel:
        return engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)


def generate(target: str, prompt_ids: list[int]) -> textgen_pb2.GenerateResponse:
    with grpc.insecure_channel(target) as channel:
        request = textgen_pb2.GenerateRequest(token_ids={"ids": prompt_ids})
        request.sampling.max_tokens = 2
        request.sampling.ignore_eos = True
        return list(textgen_pb2_grpc.TextGenerationServiceStub(channel).Generate(request, timeout=TIMEOUT_S))[-1]


def start_router(engines: list[ServiceProcess], tiny_model: str) -> ServiceProcess:
    """A tokenizer service over both engines, returned once both replicas are ready and their KV event
    snapshots are in its index (it logs one line per snapshot)."""
    tokenizer = ServiceProcess("tokenizer", ["--engine", ",".join(e.target for e in engines), "--model", tiny_model,
                                             "--workers", "1", "--grace-period", "1"])
    wait_health(tokenizer.target, TEXTGEN_SERVICE, process=tokenizer)
    for _ in engines:
        tokenizer.wait_line(re.compile(r"KV events followed, snapshot of \d+ cached blocks"), TIMEOUT_S)
    return tokenizer


def test_requests_go_to_the_replica_that_holds_their_prefix(engines, tiny_model):
    first, second = engines
    # NOTE: first's prefix is asked for first: with no index, a tie between idle replicas goes to the second.
    holders = [(first, prefix(7)), (second, prefix(8))]
    for engine, ids in holders:
        generate_direct(engine, ids)
    tokenizer = start_router(engines, tiny_model)
    try:
        before = [load(engine) for engine in engines]
        for round_number in range(3):
            for engine, ids in holders:
                response = generate(tokenizer.target, [*ids, 20 + round_number, 30 + round_number])
                assert response.usage.cached_tokens == PREFIX_LEN, (engine.target, response.usage)
        after = [load(engine) for engine in engines]
        for b, a in zip(before, after):
            assert a.num_prompt_tokens - b.num_prompt_tokens == 3 * (PREFIX_LEN + 2)
            assert a.num_cached_prompt_tokens - b.num_cached_prompt_tokens == 3 * PREFIX_LEN
    finally:
        tokenizer.stop()

"""/metrics and request logs of both services, for real: 2 engine API fronts and 2 tokenizer workers.

Each scrape must count every request exactly once, whichever process served it: the counts are compared with
the number of requests sent (deltas between a scrape before and one after), and the json request lines show
that both processes of each service served some of them. Tiny random-weight checkpoint carrying the default
tokenizer (bench/tiny_model.py), so both services load in seconds.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from tests.services.helpers import wait_engine_idle
from tests.services.procs import (
    ENGINE_SERVICE, HOST, TEXTGEN_SERVICE, ServiceProcess, free_port, poll_until, wait_all_serving, wait_health)

pytestmark = pytest.mark.slow

NUM_REQUESTS = 16  # per service, each on its own connection: all on one of two processes by chance: 2 ** -15
NUM_KV_BLOCKS = 256
EVIL_ID = 'evil\n{"forged": true}'
CALL_TIMEOUT_S = 120.0
SCRAPE_TIMEOUT_S = 30.0
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
TEXT_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from bench.tiny_model import write_tiny_model

    directory = str(tmp_path_factory.mktemp("tiny-model"))
    write_tiny_model(directory)
    return directory


class Observed:
    """A service process with its metrics port."""

    def __init__(self, process: ServiceProcess, metrics_port: int):
        self.process, self.metrics_port = process, metrics_port

    def scrape(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics, by (name, sorted labels)."""
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    def request_lines(self) -> list[dict]:
        entries = [json.loads(line) for line in self.process.lines if line.startswith("{")]
        return [entry for entry in entries if entry["message"] == "request finished"]


@pytest.fixture(scope="module")
def services(tiny_model) -> Iterator[tuple[Observed, Observed]]:
    started: list[ServiceProcess] = []
    try:
        engine_metrics = free_port()
        started.append(ServiceProcess("engine", [
            "--model", tiny_model, "--api-workers", "2", "--metrics-port", str(engine_metrics), "--log-format", "json",
            "--max-model-len", "1024", "--num-kvcache-blocks", str(NUM_KV_BLOCKS), "--grace-period", "1"]))
        wait_health(started[0].target, ENGINE_SERVICE, process=started[0])
        wait_all_serving(started[0], 2)
        tokenizer_metrics = free_port()
        started.append(ServiceProcess("tokenizer", [
            "--engine", started[0].target, "--model", tiny_model, "--workers", "2", "--metrics-port",
            str(tokenizer_metrics), "--log-format", "json", "--grace-period", "1"]))
        wait_health(started[1].target, TEXTGEN_SERVICE, process=started[1])
        wait_all_serving(started[1], 2)
        yield Observed(started[0], engine_metrics), Observed(started[1], tokenizer_metrics)
    finally:
        for process in reversed(started):
            process.stop()


def engine_request(index: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=f"direct-{index}", prompt_token_ids=list(range(100 + index, 108 + index)),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=3 + index % 5, ignore_eos=True))


def text_request(index: int) -> textgen_pb2.GenerateRequest:
    return textgen_pb2.GenerateRequest(
        request_id=f"text-{index}", text=f"Request number {index} says",
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=3 + index % 5, ignore_eos=True))


def call(target: str, stub_class, request) -> common_pb2.Usage:
    """One stream on its own connection; the usage of its final message."""
    with grpc.insecure_channel(target, options=OWN_CONNECTION) as channel:
        responses = list(stub_class(channel).Generate(request, timeout=CALL_TIMEOUT_S))
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return responses[-1].usage


def rejected(target: str, stub_class, request) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as error:
            list(stub_class(channel).Generate(request, timeout=CALL_TIMEOUT_S))
    return error.value.code()


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def scrape_when(observed: Observed, before: dict, name: str, expected: float, **labels) -> dict:
    """A scrape once `name` has grown by `expected` (a process counts a request just after its last message)."""
    return poll_until(lambda: (lambda now: now if delta(now, before, name, **labels) >= expected else None)(
        observed.scrape()), SCRAPE_TIMEOUT_S, f"{name}{labels} to grow by {expected}")


def test_metrics_count_each_request_once_across_processes(services):
    engine, tokenizer = services
    engine_target, tokenizer_target = engine.process.target, tokenizer.process.target
    engine_before, tokenizer_before = engine.scrape(), tokenizer.scrape()
    with ThreadPoolExecutor(8) as pool:
        direct = list(pool.map(lambda i: call(engine_target, engine_pb2_grpc.EngineServiceStub, engine_request(i)),
                               range(NUM_REQUESTS)))
        relayed = list(pool.map(lambda i: call(tokenizer_target, textgen_pb2_grpc.TextGenerationServiceStub,
                                               text_request(i)), range(NUM_REQUESTS)))
    bad = engine_pb2.GenerateRequest(request_id="bad-token", prompt_token_ids=[10**6])
    assert rejected(engine_target, engine_pb2_grpc.EngineServiceStub, bad) == grpc.StatusCode.INVALID_ARGUMENT
    bad_text = textgen_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(temperature=-1.0))
    assert rejected(tokenizer_target, textgen_pb2_grpc.TextGenerationServiceStub,
                    bad_text) == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(engine_target) as channel:
        wait_engine_idle(engine_pb2_grpc.EngineServiceStub(channel))

    usages = direct + relayed
    num_calls = len(usages)
    after = scrape_when(engine, engine_before, "llmserve_requests_total", num_calls, code="OK")
    completion = sum(usage.completion_tokens for usage in usages)
    assert delta(after, engine_before, "llmserve_requests_total", code="OK") == num_calls
    assert delta(after, engine_before, "llmserve_requests_total", code="INVALID_ARGUMENT") == 1
    assert delta(after, engine_before, "llmserve_request_success_total", finished_reason="length") == num_calls
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(after, engine_before, f"llmserve_{histogram}_count") == num_calls, histogram
    assert delta(after, engine_before, "llmserve_inter_token_latency_seconds_count") == completion - num_calls
    assert delta(after, engine_before, "llmserve_generation_tokens_total") == completion
    assert delta(after, engine_before, "llmserve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert {name: after[(name, ())] for name in ("llmserve_num_requests_running", "llmserve_num_requests_waiting",
                                                 "llmserve_kv_cache_used_blocks", "llmserve_kv_cache_total_blocks")} \
        == {"llmserve_num_requests_running": 0, "llmserve_num_requests_waiting": 0,
            "llmserve_kv_cache_used_blocks": 0, "llmserve_kv_cache_total_blocks": NUM_KV_BLOCKS}

    after = scrape_when(tokenizer, tokenizer_before, "llmserve_requests_total", NUM_REQUESTS, code="OK")
    assert delta(after, tokenizer_before, "llmserve_requests_total", code="OK") == NUM_REQUESTS
    assert delta(after, tokenizer_before, "llmserve_requests_total", code="INVALID_ARGUMENT") == 1
    assert delta(after, tokenizer_before, "llmserve_request_success_total", finished_reason="length") == NUM_REQUESTS
    assert delta(after, tokenizer_before, "llmserve_time_to_first_token_seconds_count") == NUM_REQUESTS
    assert delta(after, tokenizer_before, "llmserve_e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert delta(after, tokenizer_before, "llmserve_prompt_tokens_total") == sum(u.prompt_tokens for u in relayed)
    assert delta(after, tokenizer_before, "llmserve_generation_tokens_total") == sum(
        u.completion_tokens for u in relayed)
    assert delta(after, tokenizer_before, "llmserve_engine_requests_total", engine=engine_target) == NUM_REQUESTS
    assert after[("llmserve_num_requests_in_flight", ())] == 0

    # Both processes of each service served some of the requests counted above: the sums span processes.
    for observed, ids in ((engine, [engine_request(i).request_id for i in range(NUM_REQUESTS)]),
                          (tokenizer, [f"text-{i}" for i in range(NUM_REQUESTS)])):
        lines = [entry for entry in observed.request_lines() if entry["request_id"] in ids]
        assert Counter(entry["request_id"] for entry in lines) == Counter(ids)
        assert len({entry["pid"] for entry in lines}) == 2


def test_json_request_lines_carry_the_fields_and_keep_a_forged_id_on_one_line(services):
    engine, tokenizer = services
    call(engine.process.target, engine_pb2_grpc.EngineServiceStub, engine_request(0))
    usage = call(tokenizer.process.target, textgen_pb2_grpc.TextGenerationServiceStub, text_request(1))
    entry = poll_until(lambda: next((e for e in tokenizer.request_lines() if e["request_id"] == "text-1"), None),
                       SCRAPE_TIMEOUT_S, "the tokenizer's request line")
    assert {key: entry[key] for key in ("code", "finish_reason", "prompt_tokens", "completion_tokens",
                                        "cached_tokens", "engine")} == {
        "code": "OK", "finish_reason": "length", "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens, "cached_tokens": usage.cached_tokens,
        "engine": engine.process.target}
    assert 0 < entry["ttft_s"] <= entry["e2e_s"]
    forged = engine_pb2.GenerateRequest(request_id=EVIL_ID, prompt_token_ids=[1, 2, 3])
    assert rejected(engine.process.target, engine_pb2_grpc.EngineServiceStub, forged) == grpc.StatusCode.INVALID_ARGUMENT
    evil = poll_until(lambda: next((e for e in engine.request_lines() if e["request_id"] == EVIL_ID), None),
                      SCRAPE_TIMEOUT_S, "the engine's line for the refused forged id")
    assert evil["code"] == "INVALID_ARGUMENT" and evil["completion_tokens"] == 0
    for observed in (engine, tokenizer):  # every log line is one JSON object: none in text, none forged
        lines = observed.process.lines
        assert not [line for line in lines if TEXT_LOG_LINE.match(line) or line.startswith('{"forged"')]
        assert all(isinstance(json.loads(line), dict) for line in lines if line.startswith("{"))

"""Metric computation: a request's record, its end (codes, finish reasons), the per-service metrics it feeds,
the engine's figures, the bulk histogram observation and the core's queue time. In-process registries only."""

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.exposition import generate_latest

from services.common.metrics import RequestObserver, RequestRecord, observe_many
from services.engine.core.interfaces import EngineStats
from services.engine.core.sampling_params import SamplingParams
from services.engine.serving.metrics import EngineMetrics, EngineStatsCollector
from services.tokenizer.serving import metrics as tokenizer_metrics
from services.tokenizer.serving.metrics import TokenizerMetrics
from tests.unit.test_engine_core import make_engine, prompt, run_all

LENGTH, STOP = 1, 2
ENGINE = "10.0.0.7:50052"


class Clock:
    """A RequestClock stand-in with fixed marks."""

    def __init__(self, arrival: float, first_token: float | None):
        self.arrival, self.first_token = arrival, first_token


def finished_record(arrival=100.0, first_token=100.25, finish=101.25, num_completion_tokens=5) -> RequestRecord:
    record = RequestRecord("r-1", Clock(arrival, first_token), admitted=True)
    record.finish(LENGTH, 7, num_completion_tokens, 4)
    record.finish_time = finish
    return record


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def samples(registry: CollectorRegistry) -> dict:
    """Every sample but the creation times, by name and labels."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value for family in registry.collect()
            for sample in family.samples if not sample.name.endswith("_created")}


def code_name(exc: BaseException) -> str:
    return "CANCELLED" if isinstance(exc, asyncio.CancelledError) else "INVALID_ARGUMENT"


def test_a_record_times_its_first_token_end_and_gaps():
    record = finished_record()
    assert record.ttft_s == pytest.approx(0.25)
    assert record.e2e_s == pytest.approx(1.25)
    mean, num_gaps = record.inter_token()
    assert (mean, num_gaps) == (pytest.approx(0.25), 4)  # 1.0 s of decode over the 4 tokens after the first
    assert record.finish_reason == "length" and record.num_cached_tokens == 4


def test_a_record_with_one_token_or_none_has_no_gaps():
    assert finished_record(num_completion_tokens=1).inter_token() == (0.0, 0)
    never = RequestRecord("r-2", Clock(100.0, None))
    assert never.ttft_s is None and never.inter_token() == (0.0, 0)


def test_observe_many_equals_as_many_observations():
    bulk, single = CollectorRegistry(), CollectorRegistry()
    buckets = (0.01, 0.1, 1.0)
    bulk_histogram = Histogram("h", "h", buckets=buckets, registry=bulk)
    single_histogram = Histogram("h", "h", buckets=buckets, registry=single)
    for amount, count in ((0.01, 3), (0.05, 2), (5.0, 4), (0.5, 0)):
        observe_many(bulk_histogram, amount, count)
        for _ in range(count):
            single_histogram.observe(amount)
    assert samples(bulk) == pytest.approx(samples(single))
    assert value(bulk, "h_bucket", le="0.01") == 3 and value(bulk, "h_bucket", le="+Inf") == 9


def test_engine_metrics_count_a_finished_request_once():
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    record = finished_record()
    record.queue_time_s = 0.125
    metrics.finish(record)
    assert value(registry, "llmserve_requests_total", code="OK") == 1
    assert value(registry, "llmserve_request_success_total", finished_reason="length") == 1
    assert value(registry, "llmserve_time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value(registry, "llmserve_e2e_request_latency_seconds_sum") == pytest.approx(1.25)
    assert value(registry, "llmserve_inter_token_latency_seconds_count") == 4
    assert value(registry, "llmserve_inter_token_latency_seconds_sum") == pytest.approx(1.0)
    assert value(registry, "llmserve_request_queue_time_seconds_count") == 1


def test_a_rejected_request_counts_its_code_and_nothing_else():
    registry = CollectorRegistry()
    observer = RequestObserver(logging.getLogger("test.metrics"), EngineMetrics(registry))
    with pytest.raises(ValueError):
        with observer.track("r-1", Clock(time.monotonic(), None), code_name):
            raise ValueError("bad sampling")
    assert value(registry, "llmserve_requests_total", code="INVALID_ARGUMENT") == 1
    for name in ("llmserve_request_success_total", "llmserve_time_to_first_token_seconds_count",
                 "llmserve_e2e_request_latency_seconds_count"):
        assert registry.get_sample_value(name) in (None, 0.0), name


def test_a_call_cancelled_mid_stream_finished_as_abort():
    observer = RequestObserver(logging.getLogger("test.metrics"))
    with pytest.raises(asyncio.CancelledError):
        with observer.track("r-1", Clock(time.monotonic(), None), code_name) as record:
            record.admitted = True
            raise asyncio.CancelledError
    assert (record.code, record.finish_reason) == ("CANCELLED", "abort")


def test_a_call_cancelled_before_admission_has_no_finish_reason():
    observer = RequestObserver(logging.getLogger("test.metrics"))
    with pytest.raises(asyncio.CancelledError):
        with observer.track("r-1", Clock(time.monotonic(), None), code_name) as record:
            raise asyncio.CancelledError
    assert (record.code, record.finish_reason) == ("CANCELLED", None)


def test_a_call_cancelled_after_its_final_message_is_ok():
    observer = RequestObserver(logging.getLogger("test.metrics"))
    with pytest.raises(asyncio.CancelledError):
        with observer.track("r-1", Clock(time.monotonic(), None), code_name) as record:
            record.admitted = True
            record.finish(STOP, 3, 2, 0)
            raise asyncio.CancelledError
    assert (record.code, record.finish_reason) == ("OK", "stop")


def test_a_failing_metric_never_changes_the_call(caplog):
    class Broken:
        def start(self):
            pass

        def finish(self, record):
            raise RuntimeError("disk full")

    observer = RequestObserver(logging.getLogger("test.metrics"), Broken())
    with observer.track("r-1", Clock(time.monotonic(), None), code_name):
        pass
    assert "recording request 'r-1' failed" in caplog.text


def test_the_engine_figures_come_from_the_core_stats():
    registry = CollectorRegistry()
    stats = EngineStats(num_running=3, num_waiting=2, num_used_blocks=16, num_free_blocks=48, num_total_blocks=64,
                        num_preemptions=1, num_cached_prompt_tokens=32, num_computed_prompt_tokens=100,
                        num_generated_tokens=77)
    registry.register(EngineStatsCollector(lambda: stats))
    expected = {"llmserve_num_requests_running": 3, "llmserve_num_requests_waiting": 2,
                "llmserve_kv_cache_used_blocks": 16, "llmserve_kv_cache_total_blocks": 64,
                "llmserve_kv_cache_usage_perc": 0.25, "llmserve_num_preemptions_total": 1,
                "llmserve_prompt_tokens_total": 132, "llmserve_generation_tokens_total": 77,
                "llmserve_prefix_cache_hits_total": 32}
    assert {name: value(registry, name) for name in expected} == expected
    # the text exposition is what Prometheus parses: one family per name, counters typed as counters
    families = {family.name: family.type for family in text_string_to_metric_families(generate_latest(registry).decode())}
    assert families["llmserve_num_preemptions"] == "counter" and families["llmserve_num_requests_running"] == "gauge"


def test_tokenizer_metrics_count_tokens_the_replica_and_its_errors():
    registry = CollectorRegistry()
    metrics = TokenizerMetrics(registry)
    metrics.start()
    assert value(registry, "llmserve_num_requests_in_flight") == 1
    record = finished_record()
    record.engine = ENGINE
    metrics.finish(record)
    failed = RequestRecord("r-2", Clock(100.0, None), code="UNAVAILABLE", engine=ENGINE, engine_code="UNAVAILABLE")
    metrics.start()
    metrics.finish(failed)
    gone = RequestRecord("r-3", Clock(100.0, None), code="CANCELLED", engine=ENGINE)
    metrics.start()
    metrics.finish(gone)
    # the client's deadline, passed on to the engine call, ends it there first: not the engine's fault
    late = RequestRecord("r-4", Clock(100.0, None), code="DEADLINE_EXCEEDED", engine=ENGINE,
                         engine_code="DEADLINE_EXCEEDED")
    metrics.start()
    metrics.finish(late)
    assert value(registry, "llmserve_num_requests_in_flight") == 0
    assert value(registry, "llmserve_engine_requests_total", engine=ENGINE) == 4
    assert value(registry, "llmserve_engine_errors_total", engine=ENGINE, code="UNAVAILABLE") == 1
    assert value(registry, "llmserve_engine_errors_total", engine=ENGINE, code="CANCELLED") == 0
    assert value(registry, "llmserve_engine_errors_total", engine=ENGINE, code="DEADLINE_EXCEEDED") == 0
    assert (value(registry, "llmserve_prompt_tokens_total"), value(registry, "llmserve_generation_tokens_total"),
            value(registry, "llmserve_prefix_cache_hits_total")) == (7, 5, 4)
    assert value(registry, "llmserve_requests_total", code="UNAVAILABLE") == 1


def test_routing_records_go_to_the_enabled_metrics_only(monkeypatch):
    tokenizer_metrics.record_routing("prefix", ENGINE)  # off: a no-op
    registry = CollectorRegistry()
    monkeypatch.setattr(tokenizer_metrics, "_metrics", TokenizerMetrics(registry))
    tokenizer_metrics.record_routing("prefix", ENGINE)
    tokenizer_metrics.record_engine_result(ENGINE, "RESOURCE_EXHAUSTED")
    assert value(registry, "llmserve_routing_decisions_total", policy="prefix", engine=ENGINE) == 1
    assert value(registry, "llmserve_engine_errors_total", engine=ENGINE, code="RESOURCE_EXHAUSTED") == 1


def test_the_core_reports_queue_time_on_the_final_output_only():
    engine = make_engine()
    engine.add_request("late", prompt(6), SamplingParams(max_tokens=3, ignore_eos=True),
                       arrival_time=time.monotonic() - 5.0)
    outputs = run_all(engine)["late"]
    assert [output.queue_time_s is None for output in outputs] == [True, True, False]
    assert outputs[-1].queue_time_s >= 5.0


def test_queue_time_ends_at_the_first_chunk_of_a_chunked_prefill():
    engine = make_engine(max_num_batched_tokens=8)
    arrival = time.monotonic() - 5.0
    engine.add_request("long", prompt(40), SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=arrival)
    before = time.monotonic()
    assert engine.step() == []  # the first of five chunks
    after = time.monotonic()
    [output] = run_all(engine)["long"]
    assert before - arrival <= output.queue_time_s <= after - arrival


def test_a_request_aborted_before_it_ran_has_no_queue_time():
    engine = make_engine()
    engine.add_request("gone", prompt(6), SamplingParams(max_tokens=3))
    engine.abort_request("gone")
    [output] = engine.step()
    assert output.finish_reason is not None and output.queue_time_s is None

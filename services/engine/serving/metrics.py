"""The engine service's Prometheus metrics (design: services.common.metrics).

Per front process, recorded at each request's end into the multiprocess directory: requests by gRPC status
code and by finish reason, TTFT, inter-token, end-to-end and queue-time histograms (`EngineMetrics`). Engine-
wide, read at scrape time from the core's figures carried by the step messages (`EngineStatsCollector`):
running and waiting requests, KV blocks, preemptions, prompt, generated and prefix-cache-hit tokens.
Names follow vLLM's (`vllm:x` -> `llmserve_x`) where vLLM has the metric.
"""

from collections.abc import Callable

from services.common.metrics import (
    ITL_BUCKETS_S, REQUEST_BUCKETS_S, TTFT_BUCKETS_S, RequestRecord, call_counters, observe_many,
    require_multiprocess)
from services.engine.core.interfaces import EngineStats


class EngineMetrics:
    """What one front records of its own requests (one instance per process)."""

    def __init__(self, registry=None):
        """registry=None (serving): the multiprocess directory; a CollectorRegistry in unit tests."""
        from prometheus_client import Histogram

        if registry is None:
            require_multiprocess()
        self.requests, self.request_success = call_counters(registry)
        self.ttft = Histogram("llmserve_time_to_first_token_seconds", "Time from a call's arrival at the front to "
                              "its first token there", buckets=TTFT_BUCKETS_S, registry=registry)
        self.inter_token = Histogram("llmserve_inter_token_latency_seconds", "Time between two tokens of a request "
                                     "(each request's mean, once per gap)", buckets=ITL_BUCKETS_S, registry=registry)
        self.e2e = Histogram("llmserve_e2e_request_latency_seconds", "Time from a call's arrival to its final "
                             "token", buckets=REQUEST_BUCKETS_S, registry=registry)
        self.queue_time = Histogram("llmserve_request_queue_time_seconds", "Time a request waited in the engine's "
                                    "queue before it was first scheduled", buckets=REQUEST_BUCKETS_S,
                                    registry=registry)

    def start(self) -> None:
        pass

    def finish(self, record: RequestRecord) -> None:
        self.requests.labels(record.code).inc()
        if record.finish_reason is not None:
            self.request_success.labels(record.finish_reason).inc()
        ttft = record.ttft_s
        if ttft is not None:
            self.ttft.observe(ttft)
        if record.finish_time is not None:
            self.e2e.observe(record.e2e_s)
            observe_many(self.inter_token, *record.inter_token())
        if record.queue_time_s is not None:
            self.queue_time.observe(record.queue_time_s)


class EngineStatsCollector:
    """The engine-wide figures, from the latest EngineStats this process heard from the core (`stats()`)."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def describe(self):
        return []  # NOTE: no descriptions: the registry then collects at scrape time only, never at registration

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._stats()
        yield GaugeMetricFamily("llmserve_num_requests_running", "Requests in the running set (prefilled, decoding)",
                                value=stats.num_running)
        yield GaugeMetricFamily("llmserve_num_requests_waiting", "Requests waiting to be scheduled (new or preempted)",
                                value=stats.num_waiting)
        yield GaugeMetricFamily("llmserve_kv_cache_used_blocks", "KV-cache blocks held by requests",
                                value=stats.num_used_blocks)
        yield GaugeMetricFamily("llmserve_kv_cache_total_blocks", "KV-cache blocks in all",
                                value=stats.num_total_blocks)
        yield GaugeMetricFamily("llmserve_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)",
                                value=stats.num_used_blocks / max(stats.num_total_blocks, 1))
        yield CounterMetricFamily("llmserve_num_preemptions", "Preemptions (a running request's KV freed, to be "
                                  "recomputed)", value=stats.num_preemptions)
        yield CounterMetricFamily("llmserve_prompt_tokens", "Prompt tokens prefilled, computed or from the prefix "
                                  "cache (recomputed ones count again)",
                                  value=stats.num_cached_prompt_tokens + stats.num_computed_prompt_tokens)
        yield CounterMetricFamily("llmserve_generation_tokens", "Tokens generated", value=stats.num_generated_tokens)
        yield CounterMetricFamily("llmserve_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  value=stats.num_cached_prompt_tokens)

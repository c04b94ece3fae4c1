"""The tokenizer service's Prometheus metrics (design: services.common.metrics): all per worker process, merged.

What a client sees: calls by status code and by finish reason, TTFT and end-to-end latency measured here,
prompt, completion and cached tokens, calls in flight; and per engine replica (label `engine`, its target):
the engine calls made and the ones that failed, and the routing decisions.

`record_engine_result` and `record_routing` are module functions, no-ops while metrics are off, so that the
code choosing a replica records without holding a metrics object. A request's own replica and the engine's
answer code (RequestRecord.engine / engine_code) are recorded when the request ends; call
`record_engine_result` yourself only for attempts the request did not end on (e.g. a retry elsewhere).
"""

from services.common.metrics import (
    CLIENT_GONE_CODES, REQUEST_BUCKETS_S, TTFT_BUCKETS_S, RequestRecord, call_counters, require_multiprocess)

_metrics: "TokenizerMetrics | None" = None


class TokenizerMetrics:
    """One per worker process (`enable()`); unit tests build their own with a CollectorRegistry."""

    def __init__(self, registry=None):
        from prometheus_client import Counter, Gauge, Histogram

        if registry is None:
            require_multiprocess()
        self.requests, self.request_success = call_counters(registry)
        self.in_flight = Gauge("llmserve_num_requests_in_flight", "Generate calls in progress",
                               multiprocess_mode="livesum", registry=registry)
        self.ttft = Histogram("llmserve_time_to_first_token_seconds", "Time from a call's arrival to its first "
                              "token here", buckets=TTFT_BUCKETS_S, registry=registry)
        self.e2e = Histogram("llmserve_e2e_request_latency_seconds", "Time from a call's arrival to its final "
                             "token here", buckets=REQUEST_BUCKETS_S, registry=registry)
        self.prompt_tokens = Counter("llmserve_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.generation_tokens = Counter("llmserve_generation_tokens", "Completion tokens sent to clients",
                                         registry=registry)
        self.cached_tokens = Counter("llmserve_prefix_cache_hits", "Prompt tokens the engines served from their "
                                     "prefix cache", registry=registry)
        self.engine_requests = Counter("llmserve_engine_requests", "Engine calls, by engine replica", ["engine"],
                                       registry=registry)
        self.engine_errors = Counter("llmserve_engine_errors", "Engine calls that failed, by engine replica and "
                                     "status code", ["engine", "code"], registry=registry)
        self.routing = Counter("llmserve_routing_decisions", "Requests sent to an engine replica, by routing policy",
                               ["policy", "engine"], registry=registry)

    def start(self) -> None:
        self.in_flight.inc()

    def finish(self, record: RequestRecord) -> None:
        self.in_flight.dec()
        self.requests.labels(record.code).inc()
        if record.finish_reason is not None:
            self.request_success.labels(record.finish_reason).inc()
        ttft = record.ttft_s
        if ttft is not None:
            self.ttft.observe(ttft)
        if record.finish_time is not None:
            self.e2e.observe(record.e2e_s)
            self.prompt_tokens.inc(record.num_prompt_tokens)
            self.generation_tokens.inc(record.num_completion_tokens)
            self.cached_tokens.inc(record.num_cached_tokens)
        if record.engine is not None:
            self.record_engine_result(record.engine, engine_code_of(record))

    def record_engine_result(self, engine: str, code: str) -> None:
        self.engine_requests.labels(engine).inc()
        if code != "OK" and code not in CLIENT_GONE_CODES:
            self.engine_errors.labels(engine, code).inc()


def engine_code_of(record: RequestRecord) -> str:
    """How the request's engine call ended: the engine's status when it failed, else OK (also when this
    service ended it: a stop string, a client gone); a failure of ours after the call began counts as the engine's."""
    if record.engine_code is not None:
        return record.engine_code
    return "OK" if record.code == "OK" or record.code in CLIENT_GONE_CODES else record.code


def enable() -> TokenizerMetrics:
    """Create this process's metrics (in the directory the parent prepared) and route the module functions to them."""
    global _metrics
    _metrics = TokenizerMetrics()
    return _metrics


def record_engine_result(engine_target: str, code: str) -> None:
    """One engine call to `engine_target` ended with gRPC status `code` (a name: "OK", "UNAVAILABLE", ...)."""
    if _metrics is not None:
        _metrics.record_engine_result(engine_target, code)


def record_routing(policy: str, engine_target: str) -> None:
    """The router (`policy`: round-robin, least-load, prefix, ...) sent a request to `engine_target`."""
    if _metrics is not None:
        _metrics.routing.labels(policy, engine_target).inc()

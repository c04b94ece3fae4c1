"""Prometheus metrics and request logs shared by both services: the per-request record, its end, the endpoint.

Design: a service is several processes (the engine: one core process and `--api-workers` gRPC fronts; the
tokenizer service: `--workers` processes on one port), and one HTTP endpoint must report the sum of all of
them, each request exactly once, whichever process served it.

- What a front process sees of its own requests (status codes, finish reasons, TTFT, inter-token, end-to-end
  and queue times, and in the tokenizer service tokens and engine replicas) is recorded by that process in
  prometheus_client's multiprocess mode: every process writes its own memory-mapped file under one
  directory, which the parent creates before it starts any other process and removes when the service exits
  (`MetricsEndpoint`); the endpoint merges the files at each scrape (MultiProcessCollector), counters and
  histograms summed. A request ends in exactly one process, so it is counted once; a worker that died keeps
  its file, so its requests still count; live gauges of a dead worker are dropped (`mark_dead`).
- What belongs to the whole engine (running and waiting requests, KV blocks, preemptions, prompt, generated
  and prefix-cache-hit tokens) has one source of truth, the engine-core process, whose figures every step
  message to the fronts already carries (GetLoad reads the same): the endpoint's process reports them at
  scrape time from its latest copy (services.engine.serving.metrics.EngineStatsCollector). Summing them over
  fronts would count them once per front; asking the core would add a message.
- Cost on the hot path: nothing per token. A request costs one record, a few histogram observations and one
  log line at its end; inter-token latency is observed per request at its end (`observe_many`).

NOTE: prometheus_client picks its value class (in-process or memory-mapped) when it is first imported, from
PROMETHEUS_MULTIPROC_DIR; so this module imports it only inside functions, and `MetricsEndpoint.prepare`
must run before anything imports it.
"""

import argparse
import bisect
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.common.logs import LOG_FORMATS, log_request

logger = logging.getLogger(__name__)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
FINISH_REASON_LABELS = {1: "length", 2: "stop", 3: "abort"}  # llmserve.common.v1.FinishReason values, vLLM's labels
CLIENT_GONE_CODES = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                  20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.5, 0.75, 1.0, 2.5)
REQUEST_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                     640.0)


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    """--metrics-port and --log-format, the same on both services."""
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on http://HOST:PORT/metrics, HOST being --host (0: off)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get("LLMSERVE_LOG_FORMAT", "text"),
                        help="text lines, or one JSON object per line for log shippers (every line, request "
                             "lines included)")


def check_observability_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be 0 (off) or a port number")
    if args.log_format not in LOG_FORMATS:
        parser.error(f"--log-format must be one of {', '.join(LOG_FORMATS)}")


@dataclass(slots=True)
class RequestRecord:
    """One Generate call as its serving process saw it: filled in while it runs, logged and counted at its end.

    `clock` has `arrival` and `first_token` (monotonic; services.common.convert.RequestClock). `admitted`: the
    request passed validation and was handed on (a call that ends CANCELLED after that finished as "abort").
    """

    request_id: str
    clock: object
    code: str = "OK"
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    finish_time: float | None = None
    end_time: float | None = None
    queue_time_s: float | None = None
    engine: str | None = None
    engine_code: str | None = None
    admitted: bool = False

    def finish(self, finish_reason: int, num_prompt_tokens: int, num_completion_tokens: int,
               num_cached_tokens: int) -> None:
        """The final message arrived: its finish reason (a FinishReason value) and token counts."""
        self.finish_time = time.monotonic()
        self.finish_reason = FINISH_REASON_LABELS.get(int(finish_reason), "abort")
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = num_completion_tokens
        self.num_cached_tokens = num_cached_tokens

    @property
    def ttft_s(self) -> float | None:
        first_token = self.clock.first_token
        return None if first_token is None else first_token - self.clock.arrival

    @property
    def e2e_s(self) -> float:
        return (self.finish_time or self.end_time or time.monotonic()) - self.clock.arrival

    def inter_token(self) -> tuple[float, int]:
        """(mean inter-token latency, number of gaps): the decode time spread over the tokens after the first."""
        first_token, num_gaps = self.clock.first_token, self.num_completion_tokens - 1
        if first_token is None or self.finish_time is None or num_gaps < 1:
            return 0.0, 0
        return (self.finish_time - first_token) / num_gaps, num_gaps

    def log_fields(self) -> dict:
        ttft = self.ttft_s
        fields = {"request_id": self.request_id, "code": self.code, "finish_reason": self.finish_reason,
                  "prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_completion_tokens,
                  "cached_tokens": self.num_cached_tokens, "ttft_s": None if ttft is None else round(ttft, 6),
                  "e2e_s": round(self.e2e_s, 6)}
        if self.queue_time_s is not None:
            fields["queue_s"] = round(self.queue_time_s, 6)
        if self.engine is not None:
            fields["engine"] = self.engine
        return fields


class RequestObserver:
    """Ends every Generate call of one process: one request log line, and its metrics when they are on.

    `metrics` has `start()` (a call began) and `finish(record)` (it ended), e.g. EngineMetrics.
    """

    def __init__(self, request_logger: logging.Logger, metrics=None):
        self.logger = request_logger
        self.metrics = metrics

    def track(self, request_id: str, clock, code_of: Callable[[BaseException], str]) -> "RequestScope":
        """`with observer.track(...) as record:` around a handler's body; `code_of` maps its exception to a code."""
        return RequestScope(self, RequestRecord(request_id, clock), code_of)

    def end(self, record: RequestRecord, exc: BaseException | None, code_of) -> None:
        record.end_time = time.monotonic()
        try:
            if exc is not None:
                code = code_of(exc)
                # NOTE: a call cancelled after its final message (the tokenizer service cancels its engine call
                # once it has the finish) has finished: it counts as OK.
                if code not in CLIENT_GONE_CODES or record.finish_time is None:
                    record.code = code
                if record.finish_reason is None and record.admitted and code in CLIENT_GONE_CODES:
                    record.finish_reason = "abort"
            log_request(self.logger, record.log_fields())
            if self.metrics is not None:
                self.metrics.finish(record)
        except Exception:  # noqa: BLE001 - observing a request must never change its outcome
            logger.exception("recording request %r failed", record.request_id)


class RequestScope:
    """The context manager of RequestObserver.track; a plain class (a generator one costs more per request)."""

    __slots__ = ("_observer", "_record", "_code_of")

    def __init__(self, observer: RequestObserver, record: RequestRecord, code_of):
        self._observer, self._record, self._code_of = observer, record, code_of

    @property
    def record(self) -> RequestRecord:
        return self._record

    def __enter__(self) -> RequestRecord:
        if self._observer.metrics is not None:
            self._observer.metrics.start()
        return self._record

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._observer.end(self._record, exc, self._code_of)
        return False


def observe_many(histogram, value: float, count: int) -> None:
    """`count` observations of `value` for the cost of one (Histogram.observe takes one value at a time).

    NOTE: uses the histogram's bucket values (prometheus_client 0.26, pinned); a unit test checks that the
    exposition equals `count` calls of observe().
    """
    if count <= 0:
        return
    histogram._sum.inc(value * count)
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, value)].inc(count)


class MetricsEndpoint:
    """The multiprocess directory and the one HTTP `/metrics` endpoint of a service (in its first process).

    `prepare()` in the parent before any other process starts and before prometheus_client is imported;
    `start(host, port, collectors)` once serving; `close()` at exit (removes the directory).
    """

    def __init__(self, directory: str):
        self.directory = directory
        self._server = None
        self.port: int | None = None

    @classmethod
    def prepare(cls) -> "MetricsEndpoint":
        if "prometheus_client" in sys.modules and not _multiprocess_values():
            raise RuntimeError("prometheus_client was imported before its multiprocess directory was set")
        directory = tempfile.mkdtemp(prefix="llmserve-metrics-")
        os.environ[MULTIPROC_ENV] = directory  # inherited by every process started from now on
        return cls(directory)

    def start(self, host: str, port: int, collectors: Iterable = ()) -> int:
        """Serve the merged metrics (plus `collectors`, e.g. the engine's figures) on http://host:port/metrics."""
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.directory)
        for collector in collectors:
            registry.register(collector)
        self._server, _ = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_port
        return self.port

    @staticmethod
    def mark_dead(pids: Iterable[int]) -> None:
        """Drop the live gauges of these processes, gone or going (their counters and histograms stay)."""
        from prometheus_client.multiprocess import mark_process_dead

        for pid in pids:
            mark_process_dead(pid, os.environ[MULTIPROC_ENV])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        shutil.rmtree(self.directory, ignore_errors=True)
        if os.environ.get(MULTIPROC_ENV) == self.directory:
            del os.environ[MULTIPROC_ENV]


def call_counters(registry=None) -> tuple:
    """The two counters both services define with one meaning: calls ended by gRPC status code, and
    requests finished by finish reason (vLLM's llmserve_request_success)."""
    from prometheus_client import Counter

    requests = Counter("llmserve_requests", "Generate calls ended, by gRPC status code", ["code"], registry=registry)
    success = Counter("llmserve_request_success", "Requests finished, by finish reason (stop, length, abort)",
                      ["finished_reason"], registry=registry)
    return requests, success


def require_multiprocess() -> None:
    """Raise unless this process records into the service's multiprocess directory (set before the import)."""
    if not os.environ.get(MULTIPROC_ENV) or not _multiprocess_values():
        raise RuntimeError(f"metrics need {MULTIPROC_ENV} set before prometheus_client is imported")


def _multiprocess_values() -> bool:
    from prometheus_client import values

    return getattr(values.ValueClass, "_multiprocess", False)

"""What ending one request costs a serving process: its log line, and its metrics when --metrics-port is on.

    python bench/metrics_cost.py [--requests N] [--tokens-per-request T]

Times RequestObserver.track(...) around a finished request (services.common.metrics), the way both services'
Generate handlers end a call, three ways in one run: logging off (the floor), the request log line only
(metrics off), and the log line plus the engine front's metrics in prometheus_client's multiprocess mode
(a temporary directory, as --metrics-port sets up). Prints CPU µs per request and per token (at T tokens per
request), and the ratio of metrics on to off. Nothing is recorded per token: that is the point of the design.
"""

import argparse
import io
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Clock:
    def __init__(self):
        self.arrival = time.monotonic()
        self.first_token = self.arrival + 0.01


def cost_us(observer, num_requests: int) -> float:
    """CPU µs per request of ending `num_requests` finished requests through `observer`."""
    start = time.process_time()
    for index in range(num_requests):
        with observer.track(f"req-{index}", Clock(), str) as record:
            record.admitted = True
            record.finish(1, 96, 48, 32)
            record.queue_time_s = 0.002
    return (time.process_time() - start) / num_requests * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--tokens-per-request", type=int, default=48)
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="llmserve-metrics-bench-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # before prometheus_client's first import
    from services.common import logs
    from services.common.metrics import MetricsEndpoint, RequestObserver
    from services.engine.serving.metrics import EngineMetrics

    logs.configure("INFO", "text", stream=io.StringIO())
    request_logger = logging.getLogger("bench.requests")
    quiet = logging.getLogger("bench.quiet")
    quiet.setLevel(logging.WARNING)
    runs = {"logging off": RequestObserver(quiet), "log line": RequestObserver(request_logger),
            "log line + metrics": RequestObserver(request_logger, EngineMetrics())}
    for observer in runs.values():
        cost_us(observer, 1000)  # warm-up
    results = {name: cost_us(observer, args.requests) for name, observer in runs.items()}
    endpoint = MetricsEndpoint(directory)
    endpoint.close()
    print(f"ending a request, {args.requests} requests, {args.tokens_per_request} tokens each (CPU time):")
    for name, us in results.items():
        print(f"  {name:20s} {us:7.1f} µs/request  {us / args.tokens_per_request:6.2f} µs/token")
    metrics_us = results["log line + metrics"] - results["log line"]
    print(f"metrics add {metrics_us:.1f} µs/request = {metrics_us / args.tokens_per_request:.2f} µs/token; "
          f"on / off: {results['log line + metrics'] / results['log line']:.2f}")


if __name__ == "__main__":
    main()

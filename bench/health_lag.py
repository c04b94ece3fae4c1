"""How long the tokenizer service keeps reporting SERVING after its only engine starts draining.

    python bench/health_lag.py                      # the embedded default model, 3 repeats
    python bench/health_lag.py --model DIR --repeats 5

Per repeat: a fresh engine service and a tokenizer service in front of it (free ports on 127.0.0.1). Once both
serve, the engine gets SIGTERM and the tokenizer's health (Check of its full service name) is asked every 5 ms
until it answers NOT_SERVING, and the engine process until it exits; printed: both times. The tokenizer follows the
engine's grpc.health.v1 Watch stream, so the lag is the Watch's delivery time, not a poll interval.
"""

import argparse
import signal
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "clients/python")]

from grpc_health.v1 import health_pb2  # noqa: E402

from tests.services.procs import (  # noqa: E402
    ENGINE_SERVICE, SMALL_ENGINE_FLAGS, TEXTGEN_SERVICE, ServiceProcess, health_status, wait_health)

ASK_EVERY_S = 0.005
SERVING = health_pb2.HealthCheckResponse.SERVING
GIVE_UP_S = 30.0


def measure_once(model: str | None) -> tuple[float | None, float | None]:
    """Seconds from the engine's SIGTERM until (the tokenizer said NOT_SERVING, the engine exited); None: not
    within GIVE_UP_S."""
    model_flags = ["--model", model] if model else []
    engine = ServiceProcess("engine", SMALL_ENGINE_FLAGS + model_flags)
    tokenizer = None
    try:
        wait_health(engine.target, ENGINE_SERVICE, process=engine)
        tokenizer = ServiceProcess("tokenizer", ["--engine", engine.target, "--grace-period", "1", *model_flags])
        wait_health(tokenizer.target, TEXTGEN_SERVICE, process=tokenizer)
        start = time.monotonic()
        engine.proc.send_signal(signal.SIGTERM)
        lag = exited = None
        while (lag is None or exited is None) and time.monotonic() - start < GIVE_UP_S:
            if lag is None and health_status(tokenizer.target, TEXTGEN_SERVICE) != SERVING:
                lag = time.monotonic() - start
            if exited is None and engine.proc.poll() is not None:
                exited = time.monotonic() - start
            time.sleep(ASK_EVERY_S)
        return lag, exited
    finally:
        for process in (tokenizer, engine):
            if process is not None:
                process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory for both services (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for repeat in range(args.repeats):
        lag, exited = measure_once(args.model)
        print(f"repeat {repeat}: after the engine's SIGTERM, the tokenizer NOT_SERVING {_seconds(lag)}, "
              f"the engine exited {_seconds(exited)}", flush=True)


def _seconds(value: float | None) -> str:
    return f"at {value:.3f} s" if value is not None else f"not within {GIVE_UP_S:.0f} s"


if __name__ == "__main__":
    main()

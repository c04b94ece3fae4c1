"""How long the tokenizer service keeps reporting SERVING after its only engine starts draining.

    python bench/health_lag.py                      # the embedded default model, 3 repeats
    python bench/health_lag.py --model DIR --repeats 5
    python bench/health_lag.py --streams 32          # with 32 streams in flight through both services

Per repeat: a fresh engine service and a tokenizer service in front of it (free ports on 127.0.0.1). Once both
serve, the engine gets SIGTERM (with --streams, once that many greedy streams are running through both services; they are
read to their end, whatever it is) and the tokenizer's health (Check of its full service name) is asked every 5 ms
until it answers NOT_SERVING, and the engine process until it exits; printed: both times. The tokenizer follows the
engine's grpc.health.v1 Watch stream, so the lag is the Watch's delivery time, not a poll interval.
"""

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "clients/python")]

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2  # noqa: E402
from llmserve import LLMServeClient  # noqa: E402

from tests.services.helpers import engine_load  # noqa: E402
from tests.services.procs import (  # noqa: E402
    ENGINE_SERVICE, TEXTGEN_SERVICE, ServiceProcess, health_status, poll_until, wait_health)

ASK_EVERY_S = 0.005
SERVING = health_pb2.HealthCheckResponse.SERVING
GIVE_UP_S = 30.0
STREAM_TOKENS = 1000  # long enough to be in flight when the SIGTERM comes
# Room for up to 16 such streams at once (a 16-token block size).
ENGINE_FLAGS = ["--max-model-len", "2048", "--num-kvcache-blocks", "1024", "--max-num-seqs", "64",
                "--max-num-batched-tokens", "1024", "--grace-period", "1"]


def start_streams(target: str, count: int) -> list[threading.Thread]:
    """`count` greedy streams through the tokenizer service, each read to its end (an error ends it too)."""
    def one(index: int) -> None:
        try:
            with LLMServeClient(target) as client:
                for _ in client.generate(f"story {index}", max_tokens=STREAM_TOKENS, ignore_eos=True, temperature=0.0,
                                         timeout=GIVE_UP_S * 2):
                    pass
        except Exception:  # noqa: BLE001 (the engine going away may end it; this bench times health only)
            pass

    threads = [threading.Thread(target=one, args=(index,), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    return threads


def measure_once(model: str | None, num_streams: int = 0) -> tuple[float | None, float | None]:
    """Seconds from the engine's SIGTERM until (the tokenizer said NOT_SERVING, the engine exited); None: not
    within GIVE_UP_S."""
    model_flags = ["--model", model] if model else []
    engine = ServiceProcess("engine", ENGINE_FLAGS + model_flags)
    tokenizer = None
    try:
        wait_health(engine.target, ENGINE_SERVICE, process=engine)
        tokenizer = ServiceProcess("tokenizer", ["--engine", engine.target, "--grace-period", "1", *model_flags])
        wait_health(tokenizer.target, TEXTGEN_SERVICE, process=tokenizer)
        threads = start_streams(tokenizer.target, num_streams)
        _wait_running(engine.target, num_streams)
        start = time.monotonic()
        engine.proc.send_signal(signal.SIGTERM)
        lag = exited = None
        while (lag is None or exited is None) and time.monotonic() - start < GIVE_UP_S:
            if lag is None and health_status(tokenizer.target, TEXTGEN_SERVICE) != SERVING:
                lag = time.monotonic() - start
            if exited is None and engine.proc.poll() is not None:
                exited = time.monotonic() - start
            time.sleep(ASK_EVERY_S)
        for thread in threads:
            thread.join(GIVE_UP_S)
        return lag, exited
    finally:
        for process in (tokenizer, engine):
            if process is not None:
                process.stop()


def _wait_running(engine_target: str, num_streams: int) -> None:
    from llmserve.engine.v1 import engine_pb2_grpc

    with grpc.insecure_channel(engine_target) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        poll_until(lambda: engine_load(stub).num_running >= num_streams or None, GIVE_UP_S,
                   f"{num_streams} streams running at once")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory for both services (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=0, help="greedy streams in flight at the SIGTERM (up to 16)")
    args = parser.parse_args()
    for repeat in range(args.repeats):
        lag, exited = measure_once(args.model, args.streams)
        print(f"repeat {repeat}: after the engine's SIGTERM, the tokenizer NOT_SERVING {_seconds(lag)}, "
              f"the engine exited {_seconds(exited)}", flush=True)


def _seconds(value: float | None) -> str:
    return f"at {value:.3f} s" if value is not None else f"not within {GIVE_UP_S:.0f} s"


if __name__ == "__main__":
    main()

"""`make serve`: start the engine and tokenizer services on this machine and say where to connect.

Ctrl-C (or SIGTERM) drains and stops both. Extra arguments go to the engine (e.g. --max-num-seqs 16).
"""

import argparse
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

READY_TIMEOUT_S = 600


def wait_serving(target: str, service: str, process: subprocess.Popen, name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                sys.exit(f"{name} exited with code {process.returncode} before it was ready")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    sys.exit(f"{name} was not ready within {READY_TIMEOUT_S}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default=os.environ.get("LLMSERVE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("LLMSERVE_PORT", "50051")))
    parser.add_argument("--engine-port", type=int, default=int(os.environ.get("LLMSERVE_ENGINE_PORT", "50052")))
    args, engine_extra = parser.parse_known_args()
    engine_target = f"127.0.0.1:{args.engine_port}"
    public_target = f"{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"

    print("starting the engine service (loading SmolLM2-135M-Instruct on the CPU) ...", flush=True)
    engine = subprocess.Popen([sys.executable, "-m", "services.engine", "--host", "127.0.0.1",
                               "--port", str(args.engine_port), *engine_extra])
    processes = [engine]
    try:
        wait_serving(engine_target, "llmserve.engine.v1.EngineService", engine, "the engine service")
        print("starting the tokenizer service ...", flush=True)
        tokenizer = subprocess.Popen([sys.executable, "-m", "services.tokenizer", "--host", args.host,
                                      "--port", str(args.port), "--engine", engine_target])
        processes.append(tokenizer)
        wait_serving(public_target, "llmserve.textgen.v1.TextGenerationService", tokenizer, "the tokenizer service")
        print_banner(public_target)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
        while all(p.poll() is None for p in processes):
            time.sleep(0.5)
        print("a service exited; stopping the other", flush=True)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
    finally:
        stop_all(processes)


def print_banner(target: str) -> None:
    print(f"""
llmserve is ready: TextGenerationService on {target}

  .venv/bin/llmserve generate "Tell me a joke" --chat --target {target}
  .venv/bin/llmserve health --target {target}
  grpcurl -plaintext -d '{{"text": "Hello", "sampling": {{"max_tokens": 16}}}}' \\
      {target} llmserve.textgen.v1.TextGenerationService/Generate

Press Ctrl-C to stop both services.
""", flush=True)


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in reversed(processes):
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


if __name__ == "__main__":
    main()

"""The overload probe of issue 8: a small engine flooded with long requests; what GetLoad shows, who is refused.

    python bench/overload_probe.py MODEL_DIR [--requests 48] [--per-wave 4] [--interval 0.25] [--max-tokens 256]
                                             [--channels 1] [engine flags, e.g. --api-workers 2]

Starts `llmserve-engine --max-num-seqs 4 --max-waiting 4` on 127.0.0.1 (port 0) with MODEL_DIR (make one with
bench/tiny_model.py), sends `--requests` greedy ignore_eos requests straight to the engine, `--per-wave` every
`--interval` seconds, polls GetLoad meanwhile, and prints: the largest num_running and num_waiting seen, how
many requests finished / were refused (RESOURCE_EXHAUSTED, with the RetryInfo delays) / failed otherwise, and
the most streams seen at once holding exactly one token while others decoded (the starvation symptom).
With `--client-retries N` the same load goes through a tokenizer service instead, sent by the Python client
with retry=RetryPolicy(max_retries=N): it prints how many requests finished and how many retries it took.
"""

import argparse
import asyncio
import os
import re
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "clients" / "python")]

import grpc  # noqa: E402
from google.rpc import error_details_pb2  # noqa: E402
from grpc_status import rpc_status  # noqa: E402
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402

LISTENING = re.compile(r"listening on [\d.]+:(\d+)")


def start_service(argv: list[str]) -> tuple[subprocess.Popen, int]:
    """`python -m services.<...>` on 127.0.0.1, port 0; returns it and its port."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO_ROOT}:{REPO_ROOT / 'clients' / 'python'}",
               HF_HUB_OFFLINE="1")
    argv = [sys.executable, "-m", *argv[:1], "--host", "127.0.0.1", "--port", "0", *argv[1:]]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        match = LISTENING.search(line)
        if match:
            # keep reading, or the service blocks on a full pipe once its log fills it
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, int(match[1])
    raise RuntimeError(f"{argv[2]} exited with {proc.wait()}")


def start_engine(model: str, extra: list[str]) -> tuple[subprocess.Popen, int]:
    return start_service(["services.engine", "--model", model, "--api-workers", "1", "--max-num-seqs", "4",
                          "--max-waiting", "4", "--max-model-len", "1024", "--num-kvcache-blocks", "512",
                          "--grace-period", "1", *extra])


async def through_client(target: str, engine_port: int, args: argparse.Namespace) -> None:
    """The same load through the tokenizer service with the Python client retrying refusals (--client-retries)."""
    from llmserve import AsyncLLMServeClient, LLMServeError, RetryPolicy
    from llmserve import retry as retry_module

    waits: list[float] = []
    real_sleep = retry_module.async_sleep

    async def counted_sleep(seconds: float) -> None:
        waits.append(seconds)
        await real_sleep(seconds)

    retry_module.async_sleep = counted_sleep
    outcomes: Counter = Counter()
    policy = RetryPolicy(max_retries=args.client_retries, max_backoff_s=5.0)
    async with AsyncLLMServeClient(target, retry=policy) as client:
        async def one(index: int) -> None:
            try:
                result = await client.complete([100 + index, 7, 8, 9], max_tokens=args.max_tokens, temperature=0,
                                               ignore_eos=True, timeout=600)
                outcomes["finished" if len(result.token_ids) == args.max_tokens else "short"] += 1
            except LLMServeError as err:
                outcomes[err.code_name] += 1

        tasks = []
        for start in range(0, args.requests, args.per_wave):
            tasks += [asyncio.create_task(one(i)) for i in range(start, min(start + args.per_wave, args.requests))]
            await asyncio.sleep(args.interval)
        await asyncio.gather(*tasks)
    print(f"through the tokenizer service, client retry={args.client_retries}: outcomes of {args.requests}: "
          f"{dict(outcomes)}; {len(waits)} retries, waits {min(waits, default=0):.2f}-{max(waits, default=0):.2f}s")


async def one_request(stub, index: int, max_tokens: int, counts: list[int], outcomes: Counter, delays: list) -> None:
    request = engine_pb2.GenerateRequest(request_id=f"probe-{index}", prompt_token_ids=[100 + index, 7, 8, 9])
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    request.sampling.max_tokens = max_tokens
    try:
        async for response in stub.Generate(request, timeout=600):
            counts[index] += len(response.token_ids)
        outcomes["finished"] += 1
    except grpc.aio.AioRpcError as exc:
        outcomes[exc.code().name] += 1
        status = rpc_status.from_call(exc)
        for detail in status.details if status else ():
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                delays.append(info.retry_delay.ToTimedelta().total_seconds())
    finally:
        counts[index] = -1  # done


async def probe(port: int, args: argparse.Namespace) -> None:
    # NOTE: one connection per channel, so with --api-workers N the kernel spreads them over the fronts.
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(args.channels)]
    try:
        await _probe(channels, args)
    finally:
        for channel in channels:
            await channel.close()


async def _probe(channels: list, args: argparse.Namespace) -> None:
    stubs = [engine_pb2_grpc.EngineServiceStub(channel) for channel in channels]
    stub = stubs[0]
    counts = [0] * args.requests
    outcomes: Counter = Counter()
    delays: list[float] = []
    peaks = Counter()
    tasks = []

    async def watch() -> None:
        while True:
            load = await stub.GetLoad(engine_pb2.GetLoadRequest())
            peaks["running"] = max(peaks["running"], load.num_running)
            peaks["waiting"] = max(peaks["waiting"], load.num_waiting)
            decoding = sum(1 for c in counts if c > 1)
            stuck = sum(1 for c in counts if c == 1)
            if decoding:
                peaks["stuck_at_one_token"] = max(peaks["stuck_at_one_token"], stuck)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    for start in range(0, args.requests, args.per_wave):
        for index in range(start, min(start + args.per_wave, args.requests)):
            tasks.append(asyncio.create_task(one_request(stubs[index % len(stubs)], index, args.max_tokens, counts,
                                                         outcomes, delays)))
        await asyncio.sleep(args.interval)
    await asyncio.gather(*tasks)
    watcher.cancel()
    print(f"GetLoad peaks: num_running {peaks['running']}, num_waiting {peaks['waiting']}; "
          f"most streams at exactly one token while others decoded: {peaks['stuck_at_one_token']}")
    print(f"outcomes of {args.requests}: {dict(outcomes)}")
    if delays:
        print(f"RetryInfo delays: min {min(delays):.2f}s, max {max(delays):.2f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--per-wave", type=int, default=4)
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--channels", type=int, default=1, help="client connections (spread over --api-workers)")
    parser.add_argument("--client-retries", type=int, default=0,
                        help="instead: send the load through a tokenizer service with the Python client retrying")
    args, extra = parser.parse_known_args()
    procs = [start_engine(args.model, extra)]
    try:
        if args.client_retries:
            procs.append(start_service(["services.tokenizer", "--model", args.model, "--workers", "1",
                                        "--engine", f"127.0.0.1:{procs[0][1]}", "--grace-period", "1"]))
            asyncio.run(through_client(f"127.0.0.1:{procs[1][1]}", procs[0][1], args))
        else:
            asyncio.run(probe(procs[0][1], args))
    finally:
        for proc, _ in reversed(procs):
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()

"""Serving benchmark: gRPC load on the tokenizer service (and on the engine service directly) vs the offline API.

    python bench/serving.py --quick                               # smoke run: 8 tiny requests, both load modes
    python bench/serving.py --concurrency 32 --max-num-seqs 32    # 64 requests, input 64-256, output 32-128
    python bench/serving.py --request-rate 4 --target HOST:P --engine-target HOST:E

Starts the engine and tokenizer services on free ports (unless --target / --engine-target name running ones),
passing the engine flags through. Requests: random `token_ids` prompts, ignore_eos, seeded. Load: --concurrency C
(C clients, each taking the next request) and/or --request-rate R (Poisson arrivals). Each mode runs through the
tokenizer service, then the same way straight at the engine's Generate. Then the services stop and the same
workload runs through the offline LLM in this process. Metrics: bench/serving_metrics.py (vLLM's definitions).
"""

import argparse
import asyncio
import collections
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bench.serving_metrics import RequestRecord, Summary, final_report, percentile, summarize, ttft_s  # noqa: E402
from llmserve.common.v1 import common_pb2  # noqa: E402
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc  # noqa: E402
from services.engine.serving.cli_args import add_engine_args, engine_args_from  # noqa: E402
from services.engine.config import EngineArgs  # noqa: E402

HOST = "127.0.0.1"
ENGINE_SERVICE = "llmserve.engine.v1.EngineService"
TEXTGEN_SERVICE = "llmserve.textgen.v1.TextGenerationService"
READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 3600.0
LISTENING = re.compile(r"llmserve-(\w+) listening on [\w.:\[\]]+:(\d+)")
# The child asks the kernel for SIGKILL when this process dies, then becomes the service (exec keeps it).
_EXEC_TIED_TO_PARENT = ("import ctypes, os, sys\nif sys.platform.startswith('linux'): ctypes.CDLL(None).prctl(1, 9)\n"
                        "os.execv(sys.argv[1], sys.argv[1:])\n")


class Service:
    """One `python -m services.<name>` child on a free port; keeps the tail of its output."""

    def __init__(self, name: str, args: list[str], threads: int | None):
        self.name = name
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "clients" / "python")]),
                   PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", LLMSERVE_LOG_LEVEL="WARNING")
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        argv = [sys.executable, "-m", f"services.{name}", "--host", HOST, "--port", "0", "--grace-period", "1", *args]
        self.proc = subprocess.Popen([sys.executable, "-c", _EXEC_TIED_TO_PARENT, *argv], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.port: int | None = None
        self._port_seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            match = LISTENING.search(line)
            if match and match[1] == self.name and self.port is None:
                self.port = int(match[2])
                self._port_seen.set()
        self._port_seen.set()

    def wait_ready(self, service: str) -> str:
        """The service's target once its health reports `service` SERVING; raises if it exits first."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        self._port_seen.wait(READY_TIMEOUT_S)
        if self.port is None:
            raise RuntimeError(self.failure("never printed its listening line"))
        target = f"{HOST}:{self.port}"
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.failure(f"exited with code {self.proc.returncode}"))
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return target
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(self.failure(f"not SERVING within {READY_TIMEOUT_S:.0f}s"))

    def failure(self, what: str) -> str:
        return f"the {self.name} service {what}; its last output:\n" + "\n".join(self.tail)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def engine_argv(engine_args: EngineArgs) -> list[str]:
    """The engine service flags that reproduce engine_args (only those that differ from the defaults)."""
    defaults = EngineArgs()
    argv = []
    for name in EngineArgs.field_names():
        value = getattr(engine_args, name)
        if value == getattr(defaults, name) or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


async def stream(call, request, num_expected: int) -> RequestRecord:
    """Send one Generate and note when each message carrying token ids arrives."""
    record = RequestRecord(num_expected, time.perf_counter())
    try:
        async for response in call(request, timeout=REQUEST_TIMEOUT_S):
            if response.token_ids:
                record.token_events.append((time.perf_counter(), len(response.token_ids)))
            if response.finish_reason:
                record.finish_reason = response.finish_reason
                record.num_cached_tokens = response.usage.cached_tokens
    except grpc.aio.AioRpcError as err:
        record.error = f"{err.code().name}: {err.details()}"
    record.end_s = time.perf_counter()
    return record


async def run_load(send, num_requests: int, mode: tuple[str, float], seed: int) -> Summary:
    """Run send(i) for every request under the mode's load; wall time runs to the last request's end."""
    kind, value = mode
    records: list[RequestRecord | None] = [None] * num_requests
    start = time.perf_counter()
    if kind == "concurrency":
        next_index = iter(range(num_requests))

        async def client() -> None:
            for index in next_index:
                records[index] = await send(index)

        await asyncio.gather(*(client() for _ in range(min(int(value), num_requests))))
    else:
        rng = random.Random(seed + 1)

        async def arrive(index: int) -> None:
            records[index] = await send(index)

        tasks = []
        for index in range(num_requests):
            tasks.append(asyncio.create_task(arrive(index)))
            await asyncio.sleep(rng.expovariate(value))
        await asyncio.gather(*tasks)
    return summarize(records, max(r.end_s for r in records) - start)


def sampling_for(defaults: common_pb2.SamplingParams, temperature: float, num_tokens: int) -> common_pb2.SamplingParams:
    """The served defaults with our temperature, length and ignore_eos: the same sampling on every path."""
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(defaults)
    sampling.ClearField("seed")
    sampling.temperature = temperature
    sampling.max_tokens = num_tokens
    sampling.ignore_eos = True
    return sampling


def salted(workload, salt: int) -> list[list[int]]:
    """The prompts with their first id replaced by `salt`, so one run cannot hit another's prefix cache."""
    return [[salt, *prompt[1:]] for prompt, _ in workload]


async def served_runs(args, workload, target: str, engine_target: str | None, info) -> list[tuple]:
    """Per mode: (mode, summary via the tokenizer service, summary direct to the engine or None).

    Every run (and the warm-up) sends the prompts under its own first token id; the cached-token row of the
    table shows that no run was served from an earlier run's prefix cache.
    """
    samplings = [sampling_for(info.default_sampling, args.temperature, n) for _, n in workload]
    next_salt = iter(range(info.vocab_size - 1, 0, -1))
    results = []
    async with grpc.aio.insecure_channel(target) as public, \
            grpc.aio.insecure_channel(engine_target or target) as internal:
        textgen = textgen_pb2_grpc.TextGenerationServiceStub(public).Generate
        engine = engine_pb2_grpc.EngineServiceStub(internal).Generate
        await asyncio.gather(public.channel_ready(), internal.channel_ready())

        def via_tokenizer(prompts, tag: str, sampling=None):
            return lambda i: stream(textgen, textgen_pb2.GenerateRequest(
                request_id=f"bench-{tag}-{i}", token_ids={"ids": prompts[i]}, sampling=sampling or samplings[i]),
                sampling.max_tokens if sampling else workload[i][1])

        def direct(prompts, tag: str):
            return lambda i: stream(engine, engine_pb2.GenerateRequest(
                request_id=f"bench-{tag}-{i}", prompt_token_ids=prompts[i], sampling=samplings[i]), workload[i][1])

        # Warm-up: one burst of full-length prompts, 2 tokens each, so the first measured run is not the cold one.
        burst = warm_up_size(args, workload)
        warm = await run_load(via_tokenizer(salted(workload, next(next_salt)), "warm-up",
                                            sampling_for(info.default_sampling, args.temperature, 2)),
                              burst, ("concurrency", burst), args.seed)
        if warm.num_failed:
            raise RuntimeError(f"warm-up failed: {warm.failures[:3]}")
        for number, mode in enumerate(args.modes):
            served = await run_load(via_tokenizer(salted(workload, next(next_salt)), f"{number}-tok"),
                                    len(workload), mode, args.seed)
            engine_only = None
            if engine_target:
                engine_only = await run_load(direct(salted(workload, next(next_salt)), f"{number}-eng"),
                                             len(workload), mode, args.seed)
            results.append((mode, served, engine_only))
    return results


async def paired_ttfts(num_pairs: int, workload, target: str, engine_target: str, info, first_id: int = 20,
                       until: threading.Event | None = None) -> tuple[list[float], list[float], list[float]]:
    """(via-tokenizer TTFTs, engine-direct TTFTs, their paired differences), in ms; see ttft_probe.

    With `until`, pairs go on past num_pairs until it is set: a probe running beside a load. Each pair's prompt
    starts with its own ids (first_id + 2 * pair, + 1 for the direct one), so no pair hits the prefix cache.
    """
    sampling = sampling_for(info.default_sampling, 0.0, 1)
    prompt = workload[0][0]
    gaps, via_ms, direct_ms = [], [], []
    max_pairs = (info.vocab_size - 1024 - first_id) // 2  # the load phases' salts come down from the top id
    async with grpc.aio.insecure_channel(target) as public, grpc.aio.insecure_channel(engine_target) as internal:
        textgen = textgen_pb2_grpc.TextGenerationServiceStub(public).Generate
        engine = engine_pb2_grpc.EngineServiceStub(internal).Generate
        pair = 0
        while pair < max_pairs and (pair < num_pairs or (until is not None and not until.is_set())):
            ids = [first_id + 2 * pair, *prompt[1:]]
            via = lambda: stream(textgen, textgen_pb2.GenerateRequest(  # noqa: E731
                request_id=f"probe-tok-{ids[0]}", token_ids={"ids": ids}, sampling=sampling), 1)
            straight = lambda: stream(engine, engine_pb2.GenerateRequest(  # noqa: E731
                request_id=f"probe-eng-{ids[0]}", prompt_token_ids=[ids[0] + 1, *ids[1:]], sampling=sampling), 1)
            first, second = (via, straight) if pair % 2 == 0 else (straight, via)
            a, b = await first(), await second()
            record_via, record_direct = (a, b) if pair % 2 == 0 else (b, a)
            if record_via.error or record_direct.error:
                raise RuntimeError(f"TTFT probe failed: {record_via.error or record_direct.error}")
            via_ms.append(ttft_s(record_via) * 1e3)
            direct_ms.append(ttft_s(record_direct) * 1e3)
            gaps.append(via_ms[-1] - direct_ms[-1])
            pair += 1
    return via_ms, direct_ms, gaps


async def ttft_probe(num_pairs: int, workload, target: str, engine_target: str, info) -> str:
    """Paired, sequential single requests (1 token) via the tokenizer service and straight to the engine.

    Pairs alternate which path goes first, so drift in the machine's speed cancels out of each difference;
    the p50 of the differences is what the tokenizer service adds to time to first token.
    """
    via_ms, direct_ms, gaps = await paired_ttfts(num_pairs, workload, target, engine_target, info)
    return (f"TTFT probe ({num_pairs} pairs, {len(workload[0][0])}-token prompt, 1 token): via tokenizer p50 "
            f"{percentile(via_ms, 50):.1f} ms, engine direct p50 {percentile(direct_ms, 50):.1f} ms, "
            f"paired difference p50 {percentile(gaps, 50):.1f} ms")


def run_offline(args, workload, info) -> float:
    """Output tokens/s of the same workload through the offline LLM in this process, after the same warm-up."""
    from services.engine import LLM, SamplingParams

    def params(num_tokens: int) -> SamplingParams:
        proto = sampling_for(info.default_sampling, args.temperature, num_tokens)
        return SamplingParams(temperature=proto.temperature, top_k=proto.top_k, min_p=proto.min_p, ignore_eos=True,
                              top_p=proto.top_p if proto.HasField("top_p") else 1.0, max_tokens=num_tokens)

    engine_args = engine_args_from(args)
    llm = LLM(**{name: getattr(engine_args, name) for name in engine_args.field_names()})
    llm.generate(salted(workload, info.vocab_size - 1)[:warm_up_size(args, workload)], params(2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in workload], [params(n) for _, n in workload], use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens, expected = sum(len(out["token_ids"]) for out in outputs), sum(n for _, n in workload)
    if num_tokens != expected:
        raise RuntimeError(f"offline produced {num_tokens} tokens, expected {expected}")
    return num_tokens / elapsed


def warm_up_size(args, workload) -> int:
    """Requests in the warm-up burst: as many as one engine step may hold at the benchmark's concurrency."""
    return min(len(workload), args.max_num_seqs, args.concurrency or len(workload))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", dest="num_seqs", type=int, default=64)
    parser.add_argument("--min-input", type=int, default=64)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--bench-seed", dest="seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--concurrency", type=int, default=None, help="fixed concurrency (default 32 if no mode)")
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    parser.add_argument("--target", default=None, help="a running tokenizer service (default: start one)")
    parser.add_argument("--engine-target", default=None, help="a running engine service (default: start one)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the engine and offline")
    parser.add_argument("--ttft-probe", type=int, default=0, metavar="PAIRS",
                        help="also time PAIRS paired single requests via the tokenizer and direct (service overhead)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 short requests, both load modes")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.model == "":
        args.model = None
    if args.quick:
        args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output = 8, 8, 32, 4, 12
        if args.concurrency is None and args.request_rate is None:
            args.concurrency, args.request_rate = 4, 8.0
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 32
    args.modes = [m for m in (("concurrency", args.concurrency), ("rate", args.request_rate)) if m[1] is not None]
    return args


def start_services(args, started: list[Service]) -> tuple[str, str | None]:
    """Start whatever --target / --engine-target do not name (appending to `started`); returns both targets."""
    engine_target, target = args.engine_target, args.target
    if target is None and engine_target is None:
        engine = Service("engine", engine_argv(engine_args_from(args)), args.threads)
        started.append(engine)
        engine_target = engine.wait_ready(ENGINE_SERVICE)
    if target is None:
        model = ["--model", args.model] if args.model else []
        tokenizer = Service("tokenizer", ["--engine", engine_target, *model], None)
        started.append(tokenizer)
        target = tokenizer.wait_ready(TEXTGEN_SERVICE)
    return target, engine_target


def main() -> None:
    from bench.offline import make_workload  # imports torch: not for the load-generating importers of stream()

    args = parse_args()
    started: list[Service] = []
    try:
        target, engine_target = start_services(args, started)
        with grpc.insecure_channel(target) as channel:
            info = textgen_pb2_grpc.TextGenerationServiceStub(channel).GetModelInfo(textgen_pb2.GetModelInfoRequest())
        workload = make_workload(args, info.vocab_size)
        print(f"workload: {len(workload)} requests, input {args.min_input}-{args.max_input}, output "
              f"{args.min_output}-{args.max_output}: {sum(len(p) for p, _ in workload)} prompt tokens, "
              f"{sum(n for _, n in workload)} output tokens; engine flags: {engine_argv(engine_args_from(args))}",
              flush=True)
        results = asyncio.run(served_runs(args, workload, target, engine_target, info))
        probe = None
        if args.ttft_probe and engine_target:
            probe = asyncio.run(ttft_probe(args.ttft_probe, workload, target, engine_target, info))
    finally:
        for service in reversed(started):
            service.stop()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    text, num_failed = final_report(results, run_offline(args, workload, info))
    print(text)
    if probe:
        print(probe)
    if num_failed:
        sys.exit(f"{num_failed} requests failed")


if __name__ == "__main__":
    main()

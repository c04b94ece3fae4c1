"""Routing benchmark: two engine replicas behind the tokenizer service, `--routing prefix` against `round-robin`.

    python bench/routing.py                  # prefix-heavy: 28 shared 512-token prefixes, 6 rounds, concurrency 8
    python bench/routing.py --quick          # smoke run: fewer prefixes and rounds
    python bench/routing.py --overload       # also: a burst past the engines' queue bound (goodput, rejected share)

Starts two engine services on the tiny Llama (bench/tiny_model.py) with a small KV cache (--num-kvcache-blocks,
default 512 blocks of 16 tokens per engine: 16 prefixes' worth), and one tokenizer service per policy, each over
both engines. The workload is the case where routing matters: a working set of shared prefixes (28 x 32 blocks =
896) larger than one engine's cache but not than both. Each request is a prefix plus a unique suffix (the
suffix and output share one block that never fills, so nothing but prefixes competes for the cache); each round
asks for every prefix once, in a fresh random order. Each policy runs the same shape of workload on its own
prefixes (a different first token), so neither is served from the other's cache; the phases alternate
(round-robin first). Reported per policy: the prompt tokens the engines served from their prefix caches (the
engines' GetLoad num_cached_prompt_tokens / num_prompt_tokens, before and after the phase, in all and per
engine) and TTFT p50/p99 at the client, then prefix's ratios to round-robin. The tiny model computes little per
token, so its TTFTs are mostly the serving path and queueing; a prefill saved matters more with a real model.

--overload: both engines with --max-num-seqs 4 --max-waiting 4, and a burst of --overload-requests long
requests at once through the tokenizer service (least-load over both, retrying a full replica on the other)
and straight at one engine: the requests that completed, the share refused with RESOURCE_EXHAUSTED, goodput.
"""

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "clients/python")]

import grpc  # noqa: E402

from bench.serving import ENGINE_SERVICE, TEXTGEN_SERVICE, Service, stream  # noqa: E402
from bench.serving_metrics import percentile, ttft_s  # noqa: E402
from bench.tiny_model import write_tiny_model  # noqa: E402
from llmserve.common.v1 import common_pb2  # noqa: E402
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc  # noqa: E402

POLICIES = ("round-robin", "prefix")
FIRST_SALT = 40_000  # prefixes start with a phase's own token id, counted down from here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: build the tiny Llama)")
    parser.add_argument("--num-prefixes", type=int, default=28)
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens per shared prefix")
    parser.add_argument("--suffix-len", type=int, default=8, help="unique tokens after the prefix")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6, help="times each prefix is asked for")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-kvcache-blocks", type=int, default=512, help="per engine")
    parser.add_argument("--repeats", type=int, default=1, help="phases per policy (alternating)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, in phase order")
    parser.add_argument("--overload", action="store_true", help="also run the overload scenario")
    parser.add_argument("--overload-requests", type=int, default=48)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 prefixes of 256 tokens, 3 rounds, 96 KV blocks per engine")
    args = parser.parse_args(argv)
    args.policies = args.policies.split(",")
    if args.quick:
        args.num_prefixes, args.prefix_len, args.rounds, args.num_kvcache_blocks = 8, 256, 3, 96
        args.overload_requests = 16
    return args


def engine_flags(args, extra: list[str] = ()) -> list[str]:
    return ["--model", args.model, "--num-kvcache-blocks", str(args.num_kvcache_blocks), "--max-model-len", "2048",
            "--max-num-seqs", "32", *extra]


def make_phase(args, salt: int, rng: random.Random) -> list[list[int]]:
    """Every request's prompt: rounds x (each prefix once, shuffled), each prefix + a unique suffix."""
    prefixes = [[salt, *(rng.randrange(10, 10_000) for _ in range(args.prefix_len - 1))]
                for _ in range(args.num_prefixes)]
    prompts = []
    for _ in range(args.rounds):
        order = list(range(args.num_prefixes))
        rng.shuffle(order)
        prompts += [prefixes[i] + [rng.randrange(10, 10_000) for _ in range(args.suffix_len)] for i in order]
    return prompts


def sampling(num_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)


async def engine_counters(engine_targets: list[str]) -> list[tuple[int, int]]:
    """(cached prompt tokens, prompt tokens) per engine, cumulative."""
    counters = []
    for target in engine_targets:
        async with grpc.aio.insecure_channel(target) as channel:
            load = await engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        counters.append((load.num_cached_prompt_tokens, load.num_prompt_tokens))
    return counters


async def run_prompts(target: str, prompts: list[list[int]], num_tokens: int, concurrency: int, tag: str):
    """Send every prompt through the tokenizer service at `concurrency`; the client records, in order."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = textgen_pb2_grpc.TextGenerationServiceStub(channel).Generate
        records = [None] * len(prompts)
        indices = iter(range(len(prompts)))

        async def client() -> None:
            for i in indices:
                request = textgen_pb2.GenerateRequest(request_id=f"{tag}-{i}", token_ids={"ids": prompts[i]},
                                                      sampling=sampling(num_tokens))
                records[i] = await stream(call, request, num_tokens)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


async def phase(args, policy: str, target: str, engine_targets: list[str], prompts) -> dict:
    before = await engine_counters(engine_targets)
    records = await run_prompts(target, prompts, args.output_len, args.concurrency, policy)
    after = await engine_counters(engine_targets)
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"{policy}: {len(failed)} requests failed, e.g. {failed[:3]}")
    ttfts = [ttft_s(r) * 1e3 for r in records]
    per_engine = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    return {"policy": policy, "cached": sum(c for c, _ in per_engine), "prompt": sum(p for _, p in per_engine),
            "per_engine": per_engine, "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99)}


async def overload(args, target: str, engine_target: str) -> list[dict]:
    """The same burst through the tokenizer service (both engines) and straight at one engine."""
    rng = random.Random(args.seed + 7)
    prompts = [[rng.randrange(10, 10_000) for _ in range(64)] for _ in range(args.overload_requests)]
    rows = []
    async with grpc.aio.insecure_channel(target) as public, grpc.aio.insecure_channel(engine_target) as internal:
        paths = {"tokenizer, 2 engines": (textgen_pb2_grpc.TextGenerationServiceStub(public).Generate, True),
                 "one engine, direct": (engine_pb2_grpc.EngineServiceStub(internal).Generate, False)}
        for name, (call, public_api) in paths.items():
            def request(i: int):
                ids = [7 + len(rows), *prompts[i][1:]]
                if public_api:
                    return textgen_pb2.GenerateRequest(request_id=f"o{len(rows)}-{i}", token_ids={"ids": ids},
                                                       sampling=sampling(64))
                return engine_pb2.GenerateRequest(request_id=f"o{len(rows)}-{i}", prompt_token_ids=ids,
                                                  sampling=sampling(64))

            records = await asyncio.gather(*(stream(call, request(i), 64) for i in range(len(prompts))))
            wall = max(r.end_s for r in records) - min(r.start_s for r in records)
            rows.append({"path": name, "done": sum(not r.error for r in records),
                         "rejected": sum(bool(r.error and r.error.startswith("RESOURCE_EXHAUSTED")) for r in records),
                         "other": sum(bool(r.error and not r.error.startswith("RESOURCE_EXHAUSTED")) for r in records),
                         "goodput": sum(r.num_tokens for r in records if not r.error) / wall})
    return rows


def report(results: list[dict], args) -> str:
    lines = [f"prefix-heavy, 2 engines x {args.num_kvcache_blocks} KV blocks: {args.num_prefixes} prefixes x "
             f"{args.prefix_len} tokens (+{args.suffix_len} unique, {args.output_len} out), {args.rounds} rounds, "
             f"concurrency {args.concurrency}",
             f"{'policy':<12} {'cached/prompt tokens':>26} {'hit':>6} {'TTFT p50':>10} {'TTFT p99':>10}  "
             "per engine: cached/prompt"]
    totals = {}
    for row in results:
        lines.append(f"{row['policy']:<12} {row['cached']:>12} / {row['prompt']:<11} {row['cached'] / row['prompt']:>6.1%}"
                     f" {row['ttft_p50']:>8.1f}ms {row['ttft_p99']:>8.1f}ms  "
                     + ", ".join(f"{c}/{p}" for c, p in row["per_engine"]))
        total = totals.setdefault(row["policy"], {"cached": 0, "p50": []})
        total["cached"] += row["cached"]
        total["p50"].append(row["ttft_p50"])
    if not {"prefix", "round-robin"} <= totals.keys():
        return "\n".join(lines)
    prefix, rr = totals["prefix"], totals["round-robin"]
    lines.append(f"prefix / round-robin: cached prompt tokens {prefix['cached'] / max(rr['cached'], 1):.2f}x, "
                 f"TTFT p50 {statistics.median(prefix['p50']) / statistics.median(rr['p50']):.2f}x")
    return "\n".join(lines)


def start_stack(args, engine_extra: list[str], policies, started: list[Service]) -> tuple[list[str], dict]:
    """Two engines and one tokenizer service per policy over both: (engine targets, {policy: target})."""
    engines = [Service("engine", engine_flags(args, engine_extra), 1) for _ in range(2)]
    started += engines
    engine_targets = [engine.wait_ready(ENGINE_SERVICE) for engine in engines]
    tokenizers = {policy: Service("tokenizer", ["--engine", ",".join(engine_targets), "--routing", policy,
                                                "--model", args.model, "--workers", "1"], None)
                  for policy in policies}
    started += tokenizers.values()
    return engine_targets, {policy: service.wait_ready(TEXTGEN_SERVICE) for policy, service in tokenizers.items()}


def run_prefix_heavy(args) -> list[dict]:
    started: list[Service] = []
    try:
        engine_targets, targets = start_stack(args, [], args.policies, started)
        rng = random.Random(args.seed)
        salts = iter(range(FIRST_SALT, 0, -1))
        for policy in args.policies:  # warm-up: both replicas in each service's rotation, the engines past first calls
            warm = [[next(salts), *range(100, 100 + args.prefix_len)] for _ in range(2 * args.concurrency)]
            asyncio.run(run_prompts(targets[policy], warm, 2, args.concurrency, f"warm-{policy}"))
        results = []
        for _ in range(args.repeats):
            for policy in args.policies:
                prompts = make_phase(args, next(salts), rng)
                results.append(asyncio.run(phase(args, policy, targets[policy], engine_targets, prompts)))
                print(f"{policy}: {results[-1]}", flush=True)
        return results
    finally:
        for service in reversed(started):
            service.stop()


def run_overload(args) -> str:
    started: list[Service] = []
    try:
        engine_targets, targets = start_stack(args, ["--max-num-seqs", "4", "--max-waiting", "4"], ["least-load"],
                                              started)
        rows = asyncio.run(overload(args, targets["least-load"], engine_targets[0]))
    finally:
        for service in reversed(started):
            service.stop()
    lines = [f"overload: {args.overload_requests} requests at once (64-token prompts, 64 out), engines with "
             "--max-num-seqs 4 --max-waiting 4",
             f"{'path':<22} {'done':>5} {'rejected':>9} {'other':>6} {'goodput tok/s':>14}"]
    for row in rows:
        lines.append(f"{row['path']:<22} {row['done']:>5} {row['rejected'] / args.overload_requests:>9.1%} "
                     f"{row['other']:>6} {row['goodput']:>14.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmserve-tiny-") as temp:
        if args.model is None:
            args.model = temp
            write_tiny_model(args.model)
        print(report(run_prefix_heavy(args), args), flush=True)
        if args.overload:
            print(run_overload(args), flush=True)


if __name__ == "__main__":
    main()

"""What SubscribeKvEvents subscribers cost the engine service: the same load with none, then with some, alternating.

    python bench/kv_events_cost.py                    # 2 fronts, 64 streams, 4 subscribers, 2 rounds
    python bench/kv_events_cost.py --subscribers 1 --rounds 3 --streams 32

Starts the engine service on the tiny Llama (bench/tiny_model.py) with --api-workers fronts and a KV cache small
enough that the workload (prompts over a few shared prefixes, ignore_eos, greedy) stores and evicts blocks all
the time. Each round runs the load twice, first with no subscriber, then with --subscribers SubscribeKvEvents
calls (each on its own connection, so they spread over the fronts) replaying every message into a set. Reported
per phase: generated tokens per second and the engine's whole process tree's CPU µs per generated token
(bench/proc_cpu.py), and for subscribed phases the messages and hashes the subscribers received; then the
ratio of the subscribed phases' CPU per token to the unsubscribed ones'. The load generator and the subscribers
run in this process, whose CPU is not counted.
"""

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "clients/python")]

import grpc  # noqa: E402

from bench.proc_cpu import CpuMeter  # noqa: E402
from bench.serving import ENGINE_SERVICE, Service  # noqa: E402
from llmserve.common.v1 import common_pb2  # noqa: E402
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402

_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class Subscriber:
    """One SubscribeKvEvents call replayed into a set; counts what it received."""

    def __init__(self, target: str):
        self.channel = grpc.aio.insecure_channel(target, options=_OWN_CONNECTION)
        self.hashes: set[int] = set()
        self.num_messages = self.num_hashes = 0
        self.task = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        call = engine_pb2_grpc.EngineServiceStub(self.channel).SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest())
        async for message in call:
            if message.snapshot:
                self.hashes = set(message.stored_block_hashes)
                continue
            self.num_messages += 1
            self.num_hashes += len(message.stored_block_hashes) + len(message.removed_block_hashes)
            self.hashes.difference_update(message.removed_block_hashes)
            self.hashes.update(message.stored_block_hashes)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.channel.close()


async def run_load(target: str, prompts: list[list[int]], max_tokens: int, concurrency: int, tag: str) -> int:
    channels = [grpc.aio.insecure_channel(target, options=_OWN_CONNECTION) for _ in range(min(concurrency, 8))]
    stubs = [engine_pb2_grpc.EngineServiceStub(channel) for channel in channels]
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    next_index = iter(range(len(prompts)))
    num_tokens = 0

    async def client(slot: int) -> None:
        nonlocal num_tokens
        for index in next_index:
            request = engine_pb2.GenerateRequest(request_id=f"{tag}-{index}", prompt_token_ids=prompts[index],
                                                 sampling=sampling)
            async for response in stubs[slot % len(stubs)].Generate(request):
                num_tokens += len(response.token_ids)

    await asyncio.gather(*(client(slot) for slot in range(concurrency)))
    for channel in channels:
        await channel.close()
    return num_tokens


def workload(args, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 49000) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    return [rng.choice(prefixes) + [rng.randrange(3, 49000) for _ in range(args.suffix_len)]
            for _ in range(args.requests)]


async def phase(args, target: str, meter: CpuMeter, seed: int, num_subscribers: int) -> dict:
    subscribers = [Subscriber(target) for _ in range(num_subscribers)]
    await asyncio.sleep(0.5)  # every subscription has its snapshot before the load starts
    prompts = workload(args, seed)
    meter.start()
    start = time.perf_counter()
    num_tokens = await run_load(target, prompts, args.max_tokens, args.streams, f"p{seed}")
    elapsed = time.perf_counter() - start
    cpu_s = meter.stop()["engine"]
    result = dict(subscribers=num_subscribers, tokens=num_tokens, tok_s=num_tokens / elapsed,
                  cpu_us_per_token=cpu_s * 1e6 / num_tokens,
                  messages=sum(s.num_messages for s in subscribers), hashes=sum(s.num_hashes for s in subscribers))
    for subscriber in subscribers:
        await subscriber.close()
    return result


async def measure(args, target: str, meter: CpuMeter) -> None:
    await run_load(target, workload(args, 999)[:args.streams], 4, args.streams, "warm")
    print(f"{'round':>5} {'subs':>4} {'tokens':>7} {'tok/s':>8} {'cpu us/tok':>10} {'messages':>8} {'hashes':>8}")
    per_token: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(args.rounds):
        for num_subscribers in (0, args.subscribers):
            seed = 2 * round_index + (num_subscribers > 0)  # new prompts each phase: stores and evictions, not hits
            r = await phase(args, target, meter, seed, num_subscribers)
            per_token[num_subscribers > 0].append(r["cpu_us_per_token"])
            print(f"{round_index:>5} {num_subscribers:>4} {r['tokens']:>7} {r['tok_s']:>8.0f} "
                  f"{r['cpu_us_per_token']:>10.1f} {r['messages']:>8} {r['hashes']:>8}", flush=True)
    ratio = sum(per_token[True]) / sum(per_token[False])
    print(f"engine CPU per token, subscribed / unsubscribed: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api-workers", type=int, default=2)
    parser.add_argument("--subscribers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=96)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-kvcache-blocks", type=int, default=1024)
    args = parser.parse_args()
    from bench.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="kv-events-") as model_dir:
        write_tiny_model(model_dir)
        engine = Service("engine", ["--model", model_dir, "--api-workers", str(args.api_workers),
                                    "--num-kvcache-blocks", str(args.num_kvcache_blocks),
                                    "--max-num-seqs", str(args.streams), "--max-model-len", "1024"], threads=1)
        try:
            target = engine.wait_ready(ENGINE_SERVICE)
            asyncio.run(measure(args, target, CpuMeter({"engine": engine.proc.pid})))
        finally:
            engine.stop()


if __name__ == "__main__":
    main()

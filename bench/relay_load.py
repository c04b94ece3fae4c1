"""Load generator for bench/tokenizer_relay.py: `python -m bench.relay_load TARGET NUM_REQUESTS CONCURRENCY MAX_TOKENS`.

Keeps CONCURRENCY greedy streams (ignore_eos) open on one channel per stream until NUM_REQUESTS are done;
prints one JSON line: tokens, messages, seconds, tokens_per_s, and the gaps between a stream's messages (p50, p99,
longest: a pause of the service shows in the last). With --slow, each client pauses 20 ms after
every 8th message (a client that reads slower than the engine streams).
"""

import asyncio
import json
import sys
import time

import grpc

from bench.serving_metrics import percentile
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "Count from one to ten:",
           "Explain gravity to a child."]


async def one_request(stub, index: int, max_tokens: int, slow: bool, gaps: list[float]) -> tuple[int, int]:
    request = textgen_pb2.GenerateRequest(text=PROMPTS[index % len(PROMPTS)])
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    request.sampling.max_tokens = max_tokens
    num_tokens = num_messages = 0
    previous = None
    async for response in stub.Generate(request, timeout=600):
        now = time.perf_counter()
        if previous is not None:
            gaps.append(now - previous)
        num_tokens += len(response.token_ids)
        num_messages += 1
        if slow and num_messages % 8 == 0:
            await asyncio.sleep(0.02)
        previous = time.perf_counter()
    assert num_tokens == max_tokens, num_tokens
    return num_tokens, num_messages


async def main(target: str, num_requests: int, concurrency: int, max_tokens: int, slow: bool) -> None:
    # One connection per stream, as separate clients have (and so that SO_REUSEPORT spreads them over workers).
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(concurrency)]
    stubs = [textgen_pb2_grpc.TextGenerationServiceStub(channel) for channel in channels]
    next_index = iter(range(num_requests))
    totals = [0, 0]
    gaps: list[float] = []  # seconds between a stream's consecutive messages (a slow reader's pauses left out)

    async def client(stub) -> None:
        for index in next_index:
            tokens, messages = await one_request(stub, index, max_tokens, slow, gaps)
            totals[0] += tokens
            totals[1] += messages

    start = time.perf_counter()
    await asyncio.gather(*(client(stub) for stub in stubs))
    seconds = time.perf_counter() - start
    for channel in channels:
        await channel.close()
    gap_ms = {f"gap_{name}_ms": percentile(gaps, q) * 1e3 if gaps else 0.0
              for name, q in (("p50", 50), ("p99", 99), ("max", 100))}
    print(json.dumps({"tokens": totals[0], "messages": totals[1], "seconds": seconds,
                      "tokens_per_s": totals[0] / seconds, **gap_ms}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), "--slow" in sys.argv))

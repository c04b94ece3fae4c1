"""The floor under a relay's CPU per token: what grpc.aio spends per server-streamed message, nothing else.

A bare grpc.aio server in its own process streams small textgen GenerateResponse messages (a 2-character
text and one token id, as the tokenizer service sends at one token per message) on concurrent streams to a
client process; the server's CPU over the run, divided by the messages, is the gRPC stack's own cost per
message. Both calling conventions are timed, alternating: a handler that awaits `context.write` and one that
yields; and, for comparison, grpc's synchronous server (a generator per stream on a thread pool). The tokenizer
service cannot spend less per token than this while it sends one message per token (`--stream-interval` on the
engine, or a client that reads slower, makes messages carry several tokens).

    python bench/grpc_message_cost.py [--streams 64] [--messages 400] [--repeats 2]
"""

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
from concurrent import futures

sys.path[:0] = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "clients", "python")]

import grpc  # noqa: E402
import psutil  # noqa: E402

from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc  # noqa: E402

SYNC_THREADS = 1024  # the sync server holds a pool thread per open stream: enough for any --streams here
LOAD_TIMEOUT_S = 300.0  # a server that never answers fails the run instead of hanging it
MODES = ("context.write", "yield", "sync")  # "sync": grpc.server on a thread pool, yielding


def _handler(mode: str, num_messages: int):
    if mode == "yield":
        async def generate(request, context):
            for i in range(num_messages):
                await asyncio.sleep(0)  # a relay waits for its next token between messages
                yield textgen_pb2.GenerateResponse(request_id="r", text="ab", token_ids=[i])
    else:
        async def generate(request, context):
            for i in range(num_messages):
                await asyncio.sleep(0)
                await context.write(textgen_pb2.GenerateResponse(request_id="r", text="ab", token_ids=[i]))
    return generate


def _serve_sync(num_messages: int, ports: mp.Queue) -> None:
    def generate(request, context):
        for i in range(num_messages):
            yield textgen_pb2.GenerateResponse(request_id="r", text="ab", token_ids=[i])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=SYNC_THREADS))
    servicer = textgen_pb2_grpc.TextGenerationServiceServicer()
    servicer.Generate = generate
    textgen_pb2_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ports.put(port)
    server.wait_for_termination()


def _serve(mode: str, num_messages: int, ports: mp.Queue) -> None:
    if mode == "sync":
        _serve_sync(num_messages, ports)
        return

    async def main() -> None:
        server = grpc.aio.server()
        servicer = textgen_pb2_grpc.TextGenerationServiceServicer()
        servicer.Generate = _handler(mode, num_messages)
        textgen_pb2_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


async def _load(port: int, num_streams: int) -> int:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(4)]
    stubs = [textgen_pb2_grpc.TextGenerationServiceStub(channel) for channel in channels]

    async def one(k: int) -> int:
        return sum([1 async for _ in stubs[k % len(stubs)].Generate(textgen_pb2.GenerateRequest(text="a"))])

    try:
        return sum(await asyncio.gather(*(one(k) for k in range(num_streams))))
    finally:
        for channel in channels:
            await channel.close()


def measure(mode: str, num_streams: int, num_messages: int) -> float:
    """Server CPU µs per message for one calling convention (after one warm-up run)."""
    # NOTE: spawned, not forked: a forked child of a process that has used grpc (a test run's) hangs in grpc.
    context = mp.get_context("spawn")
    ports = context.Queue()
    server = context.Process(target=_serve, args=(mode, num_messages, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        asyncio.run(asyncio.wait_for(_load(port, num_streams), LOAD_TIMEOUT_S))
        process = psutil.Process(server.pid)
        before = sum(process.cpu_times()[:2])
        num_received = asyncio.run(asyncio.wait_for(_load(port, num_streams), LOAD_TIMEOUT_S))
        if num_received != num_streams * num_messages:
            raise RuntimeError(f"{num_received} messages arrived, {num_streams * num_messages} were sent")
        return (sum(process.cpu_times()[:2]) - before) * 1e6 / num_received
    finally:
        server.kill()
        server.join()


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--messages", type=int, default=400, help="messages per stream")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            results[mode].append(measure(mode, args.streams, args.messages))
    print(f"grpc server CPU per streamed message, {args.streams} streams x {args.messages} messages:")
    for mode, values in results.items():
        print(f"  {mode:<14} " + ", ".join(f"{value:.1f}" for value in values) + " µs")
    best_write = min(results["context.write"])
    for mode, label in (("yield", "yield"), ("sync", "sync server")):
        best = min(results[mode])
        ratio = f"{best / best_write:.2f}" if best_write > 0 else "n/a (too few messages for the CPU clock)"
        print(f"{label} / context.write (best of each): {ratio}")
    return results


if __name__ == "__main__":
    main()

"""A client process for the load test to SIGKILL: `python -m tests.faults.stream_client TARGET NUM_STREAMS MAX_TOKENS`.

Runs NUM_STREAMS long greedy streams at once on one channel and prints `streaming <i>` when stream i has its
first message, so the test kills the process only once every one of its streams is running.
"""

import asyncio
import sys

import grpc

from llmserve.textgen.v1 import textgen_pb2_grpc
from tests.faults.stack import greedy_request

CALL_TIMEOUT_S = 300.0


async def stream(stub, index: int, max_tokens: int) -> None:
    call = stub.Generate(greedy_request(f"Client stream {index}:", max_tokens), timeout=CALL_TIMEOUT_S)
    first = True
    async for _ in call:
        if first:
            print(f"streaming {index}", flush=True)
            first = False
    print(f"finished {index}", flush=True)


async def main(target: str, num_streams: int, max_tokens: int) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
        await asyncio.gather(*(stream(stub, index, max_tokens) for index in range(num_streams)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))

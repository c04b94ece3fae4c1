"""A client process for the killed-client test: `python -m tests.services.stream_client TARGET PROMPT MAX_TOKENS`.

Starts one long greedy stream (ignore_eos) and prints `message <n> <num token ids>` per message received.
"""

import sys

import grpc

from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc


def main(target: str, prompt: str, max_tokens: int) -> None:
    request = textgen_pb2.GenerateRequest(text=prompt)
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    request.sampling.max_tokens = max_tokens
    with grpc.insecure_channel(target) as channel:
        stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
        for number, response in enumerate(stub.Generate(request, timeout=300), start=1):
            print(f"message {number} {len(response.token_ids)}", flush=True)
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

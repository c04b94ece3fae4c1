"""The stack benchmark's own processes: load generators and the offline run, each apart from the services.

Each is a `multiprocessing` child driven over a pipe with the same handshake: it prepares (connects, or loads
the model and warms up), answers "ready", waits for "go", runs, and sends back what it saw. The parent samples
the services' CPU between "go" and the answer, so setting up is never counted and the parent itself is idle
(blocked on the pipe) while the load runs. The load generators import no torch.
"""

import asyncio
import time
from dataclasses import dataclass

import grpc

from bench.serving import stream
from bench.serving_metrics import RequestRecord
from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc

ENGINE, TEXTGEN = "engine", "textgen"
# Distinct channels must be distinct TCP connections, or N front workers sharing a port would see one client.
_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
CONNECT_TIMEOUT_S = 60.0


@dataclass(slots=True)
class LoadPhase:
    """One load generator's share of a phase.

    path: ENGINE (EngineService/Generate, token ids straight to the engine) or TEXTGEN (the tokenizer service's
    Generate with token-id prompts). requests: (request_id, prompt ids, max_tokens). sampling: a serialized
    common.v1.SamplingParams sent with every request (max_tokens set per request). concurrency: streams kept
    open at once, each sending its next request when one ends; spread over num_connections channels.
    """

    path: str
    target: str
    requests: list[tuple[str, list[int], int]]
    sampling: bytes
    concurrency: int
    num_connections: int


@dataclass(slots=True)
class LoadResult:
    """What one load generator saw, and the CPU seconds it spent itself while generating the load."""

    records: list[RequestRecord]
    cpu_s: float


@dataclass(slots=True)
class OfflineRun:
    """The offline process's work: LLM(model, **engine_kwargs).generate(prompts) greedily, after a warm-up."""

    model: str
    engine_kwargs: dict
    warm_up_prompts: list[list[int]]
    prompts: list[list[int]]
    max_tokens: list[int]
    threads: int


def _request(path: str, spec: tuple[str, list[int], int], sampling: common_pb2.SamplingParams):
    request_id, prompt_ids, max_tokens = spec
    params = common_pb2.SamplingParams()
    params.CopyFrom(sampling)
    params.max_tokens = max_tokens
    if path == ENGINE:
        return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=params)
    return textgen_pb2.GenerateRequest(request_id=request_id, token_ids={"ids": prompt_ids}, sampling=params)


def _generate_call(path: str, channel: grpc.aio.Channel):
    if path == ENGINE:
        return engine_pb2_grpc.EngineServiceStub(channel).Generate
    return textgen_pb2_grpc.TextGenerationServiceStub(channel).Generate


async def _run_load(phase: LoadPhase, conn) -> LoadResult:
    channels = [grpc.aio.insecure_channel(phase.target, options=_OWN_CONNECTION)
                for _ in range(phase.num_connections)]
    try:
        await asyncio.wait_for(asyncio.gather(*(channel.channel_ready() for channel in channels)), CONNECT_TIMEOUT_S)
        calls = [_generate_call(phase.path, channel) for channel in channels]
        sampling = common_pb2.SamplingParams.FromString(phase.sampling)
        requests = [_request(phase.path, spec, sampling) for spec in phase.requests]
        records: list[RequestRecord | None] = [None] * len(requests)
        next_index = iter(range(len(requests)))

        async def client(slot: int) -> None:
            call = calls[slot % len(calls)]
            for index in next_index:
                records[index] = await stream(call, requests[index], phase.requests[index][2])

        conn.send("ready")
        await asyncio.to_thread(conn.recv)  # "go"
        cpu_start = time.process_time()
        await asyncio.gather(*(client(slot) for slot in range(min(phase.concurrency, len(requests)))))
        return LoadResult(records, time.process_time() - cpu_start)
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


def load_main(conn) -> None:
    """A load generator: runs each LoadPhase it receives (see the module docstring) until it receives None."""
    while (phase := conn.recv()) is not None:
        try:
            conn.send(asyncio.run(_run_load(phase, conn)))
        except Exception as exc:  # the parent raises it (LoadError): a load generator never fails silently
            conn.send(f"load generator failed: {exc!r}")


def offline_main(conn, run: OfflineRun) -> None:
    """The offline competitor: one greedy LLM.generate of the same workload; sends (tokens, seconds)."""
    import torch

    from services.engine import LLM, SamplingParams

    torch.set_num_threads(run.threads)
    llm = LLM(run.model, **run.engine_kwargs)
    llm.generate(run.warm_up_prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in run.max_tokens]
    conn.send("ready")
    conn.recv()  # "go"
    start = time.perf_counter()
    outputs = llm.generate(run.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    conn.send((sum(len(out["token_ids"]) for out in outputs), elapsed))

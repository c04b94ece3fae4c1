"""Helpers shared by the service tests: offline reference outputs, engine load polling, google.rpc details."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.services.procs import poll_until

IDLE_TIMEOUT_S = 20.0
# The service subprocesses run torch on one thread (procs.child_env); the reference does too, so both sum in
# the same order, and neither slows to a crawl when other work shares the two cores (OpenMP oversubscription).
NUM_TORCH_THREADS = 1


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class OfflineReference:
    """The offline engine's outputs for a request (memoized: several tests compare against the same one)."""

    def __init__(self, llm):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self._outputs: dict[str, list[dict]] = {}

    def generate(self, prompts: list[str], **sampling) -> list[dict]:
        return self._run("generate", prompts, sampling)

    def chat(self, messages: list[dict], **sampling) -> dict:
        return self._run("chat", messages, sampling)[0]

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.llm.chat_prompt_ids(messages)

    def _run(self, method: str, prompts, sampling: dict) -> list[dict]:
        from services.engine import SamplingParams

        key = json.dumps([method, prompts, sampling], sort_keys=True)
        if key not in self._outputs:
            with torch_threads(NUM_TORCH_THREADS):
                run = getattr(self.llm, method)
                self._outputs[key] = run(prompts, SamplingParams(**sampling), use_tqdm=False)
        return self._outputs[key]


def engine_load(engine_stub: engine_pb2_grpc.EngineServiceStub) -> engine_pb2.LoadReport:
    return engine_stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)


def wait_engine_idle(engine_stub: engine_pb2_grpc.EngineServiceStub,
                     timeout_s: float = IDLE_TIMEOUT_S) -> engine_pb2.LoadReport:
    """Poll GetLoad until nothing runs, nothing waits and no KV block is in use."""

    def probe() -> engine_pb2.LoadReport | None:
        load = engine_load(engine_stub)
        return load if (load.num_running, load.num_waiting, load.num_used_blocks) == (0, 0, 0) else None

    return poll_until(probe, timeout_s, "the engine to be idle with every KV block free")


def field_violations(error: grpc.RpcError) -> list[str]:
    """The google.rpc.BadRequest field names in a failed call's status details."""
    status = rpc_status.from_call(error)
    assert status is not None, f"no google.rpc.Status in the trailers of {error!r}"
    assert status.code == error.code().value[0]
    return bad_request_fields(status)


def bad_request_fields(status) -> list[str]:
    """The google.rpc.BadRequest field names in a google.rpc.Status (or anything with its wire form)."""
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            fields += [violation.field for violation in bad_request.field_violations]
    return fields

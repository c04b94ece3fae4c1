"""GenerateBatch on the real engine service: many requests on one stream behave as their own Generate calls.

Outputs equal per-request Generate calls and arrive several requests to a message; a bad request gets its
own error naming the field while the others finish; a cancel entry and a closed stream free KV within a
step (the engine core is paused while the caller acts, see engine_pause.py); a message that does not parse
ends the stream with INVALID_ARGUMENT.
"""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
from google.rpc import status_pb2

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2
from tests.services.engine_pause import (
    assert_freed_within_steps, engine_core_pid, paused, wait_requests_finished)
from tests.services.helpers import bad_request_fields, wait_engine_idle

CALL_TIMEOUT_S = 120
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21]]
MAX_TOKENS = [6, 9, 4, 7]
LONG_MAX_TOKENS = 400  # never reached: the tests that use it end the request early


def greedy(request_id: str, prompt: list[int], max_tokens: int) -> engine_pb2.GenerateRequest:
    request = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt)
    request.sampling.temperature = 0.0
    request.sampling.max_tokens = max_tokens
    request.sampling.ignore_eos = True
    return request


class Caller:
    """A GenerateBatch call fed from a queue, so a test sends its messages when it chooses."""

    _END = object()

    def __init__(self, engine_stub):
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.call = engine_stub.GenerateBatch(iter(self._outbox.get, self._END), timeout=CALL_TIMEOUT_S)
        self.responses: dict[str, list] = {}
        self.errors: dict[str, engine_pb2.RequestStatus] = {}
        self.messages: list = []

    def send(self, requests=(), cancel_request_ids=()) -> None:
        self._outbox.put(engine_pb2.GenerateBatchRequest(requests=list(requests),
                                                          cancel_request_ids=list(cancel_request_ids)))

    def half_close(self) -> None:
        self._outbox.put(self._END)

    def read_until_done(self, request_ids: set[str]) -> tuple[dict, dict, list]:
        """(responses per request id, errors per request id, the messages), all so far, once each of
        `request_ids` has ended (its last completion's finish, or an error)."""
        for message in self.call:
            self.messages.append(message)
            for response in message.responses:
                self.responses.setdefault(response.request_id, []).append(response)
            for error in message.errors:
                assert error.request_id not in self.errors, "a request got two errors"
                self.errors[error.request_id] = error.status
            if request_ids <= self.ended():
                break
        return self.responses, self.errors, self.messages

    def ended(self) -> set[str]:
        return {rid for rid, rs in self.responses.items() if rs[-1].finish_reason} | set(self.errors)


def field_violations(status: engine_pb2.RequestStatus) -> list[str]:
    """RequestStatus has google.rpc.Status's wire form: parse it as one and read its BadRequest."""
    return bad_request_fields(status_pb2.Status.FromString(status.SerializeToString()))


def generate_alone(engine_stub, request: engine_pb2.GenerateRequest) -> list[int]:
    return [i for response in engine_stub.Generate(request, timeout=CALL_TIMEOUT_S) for i in response.token_ids]


def test_requests_on_one_stream_equal_their_own_generate_calls_several_to_a_message(engine_stub, idle_engine):
    requests = [greedy(f"batch-eq-{i}", prompt, n) for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS))]
    caller = Caller(engine_stub)
    caller.send(requests)
    responses, errors, messages = caller.read_until_done({r.request_id for r in requests})
    caller.half_close()
    assert list(caller.call) == [] and caller.call.code() == grpc.StatusCode.OK  # ends once its requests have

    assert errors == {}
    for request in requests:
        ids = [i for response in responses[request.request_id] for i in response.token_ids]
        assert ids == generate_alone(engine_stub, request)
        last = responses[request.request_id][-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(request.prompt_token_ids),
                                                                            request.sampling.max_tokens)
    assert max(len(message.responses) for message in messages) >= 2, "no message carried two requests"
    wait_engine_idle(engine_stub)


def test_a_bad_request_gets_its_own_error_naming_the_field_and_the_others_finish(engine_stub, idle_engine):
    vocab_size = engine_stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest()).vocab_size
    good = [greedy("batch-good-0", PROMPTS[0], 5), greedy("batch-good-1", PROMPTS[1], 3)]
    bad_token = greedy("batch-bad-token", [1, vocab_size], 3)
    no_id = greedy("", PROMPTS[2], 3)
    too_long = greedy("batch-bad-length", PROMPTS[0], 10**6)
    caller = Caller(engine_stub)
    caller.send([good[0], bad_token, no_id, too_long, good[1]])
    responses, errors, _ = caller.read_until_done({"batch-good-0", "batch-good-1", "batch-bad-token", "",
                                                   "batch-bad-length"})
    caller.half_close()
    list(caller.call)

    assert {rid: (status.code, field_violations(status)) for rid, status in errors.items()} == {
        "batch-bad-token": (grpc.StatusCode.INVALID_ARGUMENT.value[0], ["prompt_token_ids"]),
        "": (grpc.StatusCode.INVALID_ARGUMENT.value[0], ["request_id"]),
        "batch-bad-length": (grpc.StatusCode.INVALID_ARGUMENT.value[0], ["sampling.max_tokens"]),
    }
    for request in good:
        ids = [i for response in responses[request.request_id] for i in response.token_ids]
        assert ids == generate_alone(engine_stub, request)


def test_a_duplicate_id_on_the_stream_is_refused_and_the_first_goes_on(engine_stub, idle_engine):
    first = greedy("batch-dup", PROMPTS[0], 5)
    caller = Caller(engine_stub)
    caller.send([first, greedy("batch-dup", PROMPTS[1], 5)])
    responses, errors = caller.responses, caller.errors
    while not (responses.get("batch-dup") and responses["batch-dup"][-1].finish_reason):
        caller.read_until_done(set())  # one message
    caller.half_close()
    list(caller.call)
    assert field_violations(errors["batch-dup"]) == ["request_id"]
    ids = [i for response in responses["batch-dup"] for i in response.token_ids]
    assert ids == generate_alone(engine_stub, first)


def _start_long(caller: Caller, request_id: str) -> None:
    caller.send([greedy(request_id, PROMPTS[3], LONG_MAX_TOKENS)])
    for message in caller.call:
        if any(response.request_id == request_id and response.token_ids for response in message.responses):
            return


@pytest.mark.slow
def test_a_cancel_entry_frees_the_request_within_a_step_and_the_stream_goes_on(stack, engine_stub, idle_engine):
    caller = Caller(engine_stub)
    _start_long(caller, "batch-cancel")
    with paused(engine_core_pid(stack.engine.proc.pid)):
        caller.send(cancel_request_ids=["batch-cancel"])
        at_abort = wait_requests_finished(engine_stub, idle_engine.num_finished_requests + 1)
    assert_freed_within_steps(engine_stub, at_abort)

    after = greedy("batch-after-cancel", PROMPTS[0], 4)  # the same stream still serves
    caller.send([after])
    responses, errors, _ = caller.read_until_done({"batch-after-cancel"})
    assert errors == {}
    assert [i for r in responses["batch-after-cancel"] for i in r.token_ids] == generate_alone(engine_stub, after)
    caller.half_close()
    list(caller.call)


@pytest.mark.slow
def test_closing_the_stream_aborts_its_requests_within_a_step(stack, engine_stub, idle_engine):
    caller = Caller(engine_stub)
    _start_long(caller, "batch-closed")
    with paused(engine_core_pid(stack.engine.proc.pid)):
        caller.call.cancel()
        at_abort = wait_requests_finished(engine_stub, idle_engine.num_finished_requests + 1)
    assert_freed_within_steps(engine_stub, at_abort)


def test_a_message_that_does_not_parse_ends_the_stream_with_invalid_argument(stack, idle_engine):
    with grpc.insecure_channel(stack.engine_target) as channel:
        call = channel.stream_stream("/llmserve.engine.v1.EngineService/GenerateBatch",
                                     request_serializer=lambda raw: raw,
                                     response_deserializer=engine_pb2.GenerateBatchResponse.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            list(call(iter([b"\x0a\xff\xff\xff"]), timeout=CALL_TIMEOUT_S))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in caught.value.details()


def test_the_stream_serves_requests_sent_while_others_run(engine_stub, idle_engine):
    """A request admitted mid-stream joins the running batch; the reader and writer run concurrently."""
    caller = Caller(engine_stub)
    first = greedy("batch-late-0", PROMPTS[1], 12)
    caller.send([first])
    seen = threading.Event()
    responses: dict[str, list] = {}

    for message in caller.call:
        for response in message.responses:
            responses.setdefault(response.request_id, []).append(response)
        if not seen.is_set():
            seen.set()
            caller.send([greedy("batch-late-1", PROMPTS[2], 5)])
        done = [rid for rid, rs in responses.items() if rs[-1].finish_reason]
        if len(done) == 2:
            break
    caller.half_close()
    list(caller.call)
    assert [i for r in responses["batch-late-1"] for i in r.token_ids] == generate_alone(
        engine_stub, greedy("batch-late-1", PROMPTS[2], 5))
    assert [i for r in responses["batch-late-0"] for i in r.token_ids] == generate_alone(engine_stub, first)

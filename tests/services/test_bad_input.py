"""Bad input gets INVALID_ARGUMENT with the offending field, at both services, and disturbs nothing else."""

from __future__ import annotations

import threading

import grpc
import pytest

from llmserve import FinishReason, LLMServeError
from llmserve.engine.v1 import engine_pb2
from llmserve.textgen.v1 import textgen_pb2
from tests.services.engine_pause import engine_core_pid, paused
from tests.services.helpers import engine_load, field_violations, wait_engine_idle

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
VOCAB_SIZE = 49152
GOOD_PROMPT = "The capital of France is"
GOOD_MAX_TOKENS = 32
USER = [{"role": "user", "content": "Hi"}]

# (case id, client.generate arguments, the field the violation must name)
CLIENT_CASES = [
    ("empty text", dict(prompt=""), "text"),
    ("negative temperature", dict(prompt=GOOD_PROMPT, temperature=-0.5), "sampling.temperature"),
    ("top_p 0", dict(prompt=GOOD_PROMPT, top_p=0.0), "sampling.top_p"),
    ("top_p 1.5", dict(prompt=GOOD_PROMPT, top_p=1.5), "sampling.top_p"),
    ("top_k 0", dict(prompt=GOOD_PROMPT, top_k=0), "sampling.top_k"),
    ("min_p 1", dict(prompt=GOOD_PROMPT, min_p=1.0), "sampling.min_p"),
    ("max_tokens 0", dict(prompt=GOOD_PROMPT, max_tokens=0), "sampling.max_tokens"),
    ("token id >= vocab", dict(prompt=[1, 2, VOCAB_SIZE]), "token_ids.ids"),
    ("unknown chat role", dict(messages=[{"role": "wizard", "content": "Hi"}]), "chat.messages[0].role"),
    ("empty stop string", dict(prompt=GOOD_PROMPT, stop=["ok", ""]), "stop[1]"),
]


def assert_rejected(client, arguments: dict, field: str) -> None:
    prompt = arguments.pop("prompt", None)
    with pytest.raises(LLMServeError) as caught:
        client.complete(prompt, timeout=30, **arguments)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert [violation.field for violation in caught.value.field_violations] == [field], caught.value


def assert_stub_rejected(method, request, field: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(method(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert field_violations(caught.value) == [field]


def long_text(offline, num_tokens: int) -> str:
    """A text prompt of exactly num_tokens tokens."""
    words = " ".join(["apple"] * num_tokens)
    ids = offline.tokenizer.encode(words)[:num_tokens]
    text = offline.tokenizer.decode(ids)
    assert len(offline.tokenizer.encode(text)) == num_tokens
    return text


def engine_request(request_id: str, prompt_ids: list[int], max_tokens: int = 4) -> engine_pb2.GenerateRequest:
    request = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids)
    request.sampling.temperature = 0.0
    request.sampling.max_tokens = max_tokens
    return request


@pytest.mark.parametrize("arguments, field", [case[1:] for case in CLIENT_CASES], ids=[c[0] for c in CLIENT_CASES])
def test_bad_request_names_the_field(client, arguments, field):
    assert_rejected(client, dict(arguments), field)


def test_request_without_a_prompt_names_the_prompt(textgen_stub):
    request = textgen_pb2.GenerateRequest()
    request.sampling.max_tokens = 4
    assert_stub_rejected(textgen_stub.Generate, request, "prompt")


def test_prompt_longer_than_max_model_len(client, offline):
    assert_rejected(client, dict(prompt=long_text(offline, MAX_MODEL_LEN + 1), max_tokens=1), "text")


def test_prompt_plus_max_tokens_over_max_model_len(client, offline):
    prompt = long_text(offline, MAX_MODEL_LEN - 10)
    assert_rejected(client, dict(prompt=prompt, max_tokens=11), "sampling.max_tokens")
    result = client.complete(prompt, max_tokens=10, ignore_eos=True, temperature=0.0, timeout=120)  # at the limit
    assert len(result.token_ids) == 10


@pytest.mark.parametrize("request_id, prompt_ids, field", [
    ("", [1, 2, 3], "request_id"),
    ("bad-vocab", [1, VOCAB_SIZE, 3], "prompt_token_ids"),
    ("too-long", [1] * (MAX_MODEL_LEN + 1), "prompt_token_ids"),
    ("empty", [], "prompt_token_ids"),
], ids=["empty request_id", "id >= vocab", "too long", "empty prompt"])
def test_engine_rejects_bad_requests_directly(engine_stub, request_id, prompt_ids, field):
    assert_stub_rejected(engine_stub.Generate, engine_request(request_id, prompt_ids), field)


def test_bad_requests_do_not_disturb_a_running_stream(stack, client, textgen_stub, engine_stub, offline, idle_engine):
    [reference] = offline.generate([GOOD_PROMPT], temperature=0.0, max_tokens=GOOD_MAX_TOKENS, ignore_eos=True)
    stream = client.generate(GOOD_PROMPT, temperature=0.0, max_tokens=GOOD_MAX_TOKENS, ignore_eos=True, timeout=120)
    deltas = iter(stream)
    first_delta = next(deltas)
    outcome: dict = {}

    def finish_stream() -> None:
        try:
            outcome["rest"] = list(deltas)
            outcome["result"] = stream.result()
        except Exception as exc:  # reported by the assertion below
            outcome["error"] = exc

    reader = threading.Thread(target=finish_stream, daemon=True)
    reader.start()
    # The engine core is paused through the barrage, so the good stream is mid-generation all along (validation
    # needs no engine step).
    with paused(engine_core_pid(stack.engine.proc.pid)):
        for _, arguments, field in CLIENT_CASES:
            assert_rejected(client, dict(arguments), field)
        assert_stub_rejected(engine_stub.Generate, engine_request("", [1, 2]), "request_id")
        assert_stub_rejected(engine_stub.Generate, engine_request("barrage-vocab", [VOCAB_SIZE]), "prompt_token_ids")
        assert reader.is_alive() and engine_load(engine_stub).num_running == 1
    reader.join(120)
    assert "error" not in outcome and "result" in outcome, outcome
    result = outcome["result"]
    assert first_delta + "".join(outcome["rest"]) == result.text == reference["text"]
    assert result.token_ids == reference["token_ids"] and len(result.token_ids) == GOOD_MAX_TOKENS
    assert result.finish_reason == FinishReason.LENGTH
    wait_engine_idle(engine_stub)

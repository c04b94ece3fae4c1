"""The Python client against the in-process fake TextGenerationService."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest

from llmserve import (
    AsyncLLMServeClient,
    ChatMessage,
    FinishReason,
    LLMServeClient,
    LLMServeError,
    ServingStatus,
)
from llmserve.errors import FieldViolation
from llmserve.textgen.v1 import textgen_pb2
from tests.contracts import fake_textgen
from tests.contracts.conftest import REPO_ROOT
from tests.contracts.fake_textgen import fake_reply


def expected(prompt: str, **fields: object) -> fake_textgen.FakeReply:
    """What the fake answers to a text prompt with these request fields."""
    stop = fields.pop("stop", [])
    return fake_reply(textgen_pb2.GenerateRequest(text=prompt, sampling=fields, stop=stop))


@pytest.fixture()
def client(fake_server):
    with LLMServeClient(fake_server.target) as client:
        yield client


def test_generate_yields_text_deltas_then_the_final_result(client):
    want = expected("alpha beta gamma")
    stream = client.generate("alpha beta gamma")
    deltas = list(stream)
    result = stream.result()
    assert deltas == [piece for piece in want.pieces if piece]
    assert result.text == "".join(want.pieces)
    assert result.token_ids == want.token_ids
    assert result.finish_reason == FinishReason.STOP
    assert result.matched_stop_token_id == fake_textgen.EOS_ID
    assert result.matched_stop_string is None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, len(want.token_ids))
    assert result.timing is not None and result.timing.total_s == pytest.approx(0.005)


def test_first_delta_arrives_while_the_server_is_still_generating(client, fake_server):
    gate = fake_server.servicer.add_gate("gate-client")
    want = expected("one two three")
    stream = client.generate("one two three", request_id="gate-client")
    deltas = iter(stream)
    assert next(deltas) == want.pieces[0]
    assert not gate.is_set()  # the gate is also set when the RPC ends: the call is still open
    gate.set()
    assert "".join(deltas) == "".join(want.pieces[1:])
    assert stream.result().request_id == "gate-client"


def test_cancel_reaches_the_server(client, fake_server):
    fake_server.servicer.add_gate("gate-cancel")
    stream = client.generate("one two three", request_id="gate-cancel")
    next(iter(stream))
    stream.cancel()
    with pytest.raises(LLMServeError) as info:
        stream.result()
    assert info.value.code == grpc.StatusCode.CANCELLED
    assert fake_server.servicer.cancelled["gate-cancel"].wait(10)


def test_set_sampling_fields_are_present_and_the_rest_unset(client, fake_server):
    client.complete("a b", temperature=0.0, top_k=5, seed=7, stop=["zzz"], stop_token_ids=[9])
    request = fake_server.servicer.requests[-1]
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert (request.sampling.top_k, request.sampling.seed) == (5, 7)
    assert list(request.sampling.stop_token_ids) == [9]
    assert list(request.stop) == ["zzz"]
    unset = ("top_p", "min_p", "max_tokens", "min_tokens", "ignore_eos", "num_logprobs", "repetition_penalty",
             "presence_penalty", "frequency_penalty")
    assert [name for name in unset if request.sampling.HasField(name)] == []
    assert not request.HasField("skip_special_tokens")


def test_logprobs_come_back_with_each_tokens_text(client, fake_server):
    result = client.complete("a b", num_logprobs=1, frequency_penalty=0.5)
    assert fake_server.servicer.requests[-1].sampling.frequency_penalty == 0.5
    assert [p.sampled.text for p in result.logprobs] == ["b ", "a ", ""]
    assert result.logprobs[0].sampled.logprob == -0.5
    assert [(t.token_id, t.text) for t in result.logprobs[0].top] == [(100, "t0")]
    assert result.to_dict()["logprobs"][0]["top"] == [{"token_id": 100, "text": "t0", "logprob": -0.5}]


def test_prompt_logprobs_come_back_once_with_each_tokens_text(client, fake_server):
    result = client.complete("a b c", num_prompt_logprobs=1)
    assert fake_server.servicer.requests[-1].sampling.num_prompt_logprobs == 1
    assert [p.sampled for p in result.prompt_logprobs[:1]] == [None]  # nothing predicts the first token
    assert [(p.sampled.token_id, p.sampled.text) for p in result.prompt_logprobs[1:]] == [(201, "b"), (202, "c")]
    assert [(t.token_id, t.text) for t in result.prompt_logprobs[1].top] == [(201, "t0")]
    assert result.logprobs == [] and "logprobs" not in result.to_dict()
    assert result.to_dict()["prompt_logprobs"][0] == {"sampled": None, "top": []}


def test_max_tokens_ends_with_length(client):
    result = client.complete("a b c d", max_tokens=2)
    assert result.finish_reason == FinishReason.LENGTH
    assert result.token_ids == expected("a b c d", max_tokens=2).token_ids
    assert len(result.token_ids) == 2
    assert result.matched_stop_token_id is None and result.matched_stop_string is None


def test_a_single_stop_string_is_sent_as_one_and_reported_when_matched(client):
    result = client.complete("a b c", stop="b")
    assert result.finish_reason == FinishReason.STOP
    assert result.matched_stop_string == "b"
    assert result.matched_stop_token_id is None
    assert result.text == "".join(expected("a b c", stop=["b"]).pieces)


def test_chat_messages_in_any_accepted_form(client, fake_server):
    messages = [ChatMessage("system", "be brief"), {"role": "user", "content": "x y"}, ("assistant", "p q")]
    result = client.complete(messages=messages)
    request = fake_server.servicer.requests[-1]
    sent = [(m.role, m.content) for m in request.chat.messages]
    assert sent == [("system", "be brief"), ("user", "x y"), ("assistant", "p q")]
    assert result.text == "q p "


def test_invalid_argument_carries_the_field_violation(client):
    with pytest.raises(LLMServeError) as info:
        client.complete("")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field_violations == (FieldViolation(*fake_textgen.EMPTY_PROMPT_VIOLATION),)
    assert "INVALID_ARGUMENT" in str(info.value) and "text: must not be empty" in str(info.value)


def test_resource_exhausted_carries_the_retry_delay(client):
    with pytest.raises(LLMServeError) as info:
        client.complete(fake_textgen.OVERLOAD_PROMPT)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.retry_delay_s == pytest.approx(fake_textgen.OVERLOAD_RETRY_S)


def test_stream_ending_without_a_finish_reason_is_an_error(client):
    with pytest.raises(LLMServeError) as info:
        client.complete(fake_textgen.NO_FINISH_PROMPT)
    assert info.value.code == grpc.StatusCode.INTERNAL


def test_unknown_option_is_a_type_error(client):
    with pytest.raises(TypeError, match="temprature"):
        client.generate("a", temprature=0.5)


def test_tokenize_detokenize_and_model_info(client):
    assert client.tokenize("hi").token_ids == [fake_textgen.BOS_ID, ord("h"), ord("i")]
    assert client.tokenize("hi", add_special_tokens=False).tokens == ["h", "i"]
    assert client.detokenize([ord("o"), ord("k")]) == "ok"
    info = client.model_info()
    assert (info.model_name, info.vocab_size, info.eos_token_ids) == ("fake-model", 49152, (fake_textgen.EOS_ID,))
    assert info.default_sampling == {"temperature": 0.5, "max_tokens": 256}


def test_health_reports_the_serving_status(client):
    assert client.health() == ServingStatus.SERVING
    assert client.health(fake_textgen.DRAINING_SERVICE) == ServingStatus.NOT_SERVING


def test_async_client_streams_completes_and_maps_errors(fake_server):
    async def scenario() -> None:
        async with AsyncLLMServeClient(fake_server.target) as client:
            stream = client.generate("red green blue", max_tokens=2)
            deltas = [delta async for delta in stream]
            result = await stream.result()
            assert deltas == expected("red green blue", max_tokens=2).pieces
            assert result.finish_reason == FinishReason.LENGTH
            assert (await client.complete(messages=[("user", "u v")])).text == "v u "
            with pytest.raises(LLMServeError) as info:
                await client.complete("")
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.field_violations[0].field == fake_textgen.EMPTY_PROMPT_VIOLATION[0]
            assert (await client.tokenize("a", add_special_tokens=False)).token_ids == [ord("a")]
            assert await client.health() == ServingStatus.SERVING

    asyncio.run(scenario())


def test_async_cancel_reaches_the_server(fake_server):
    fake_server.servicer.add_gate("gate-async-cancel")

    async def scenario() -> None:
        async with AsyncLLMServeClient(fake_server.target) as client:
            stream = client.generate("one two three", request_id="gate-async-cancel")
            assert await anext(aiter(stream)) == "three "
            stream.cancel()
            with pytest.raises(LLMServeError) as info:
                await stream.result()
            assert info.value.code == grpc.StatusCode.CANCELLED
            # Wait off the event loop: the loop must keep running to send the cancellation.
            assert await asyncio.to_thread(fake_server.servicer.cancelled["gate-async-cancel"].wait, 10)

    asyncio.run(scenario())


def test_the_client_does_not_import_torch():
    code = "import sys, llmserve.cli, llmserve.client; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    env = {key: value for key, value in os.environ.items()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT / "clients" / "python"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

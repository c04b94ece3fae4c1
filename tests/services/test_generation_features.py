"""Logprobs, penalties and the embedded model's sampling defaults through both real services, against the
offline engine on the same model."""

from __future__ import annotations

import grpc
import pytest

from llmserve import LLMServeError
from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MAX_TOKENS = 10
CALL_TIMEOUT_S = 120


def test_logprobs_come_through_both_services_with_each_tokens_text(client, offline, idle_engine):
    [reference] = offline.generate([PROMPT], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, num_logprobs=3)
    result = client.complete(PROMPT, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, num_logprobs=3,
                             timeout=CALL_TIMEOUT_S)
    assert result.token_ids == reference["token_ids"]
    assert len(result.logprobs) == len(result.token_ids) == MAX_TOKENS
    decode = offline.tokenizer.decode
    for token_id, position, expected in zip(result.token_ids, result.logprobs, reference["logprobs"]):
        assert position.sampled.token_id == token_id
        assert position.sampled.logprob == pytest.approx(expected.logprob, abs=1e-4)
        assert position.sampled.text == decode([token_id], skip_special_tokens=False)
        assert [entry.token_id for entry in position.top] == expected.top_token_ids
        assert [entry.text for entry in position.top] == [decode([i], skip_special_tokens=False)
                                                          for i in expected.top_token_ids]
        assert position.top[0].logprob >= position.top[1].logprob >= position.top[2].logprob


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(client, offline, idle_engine):
    [reference] = offline.generate([PROMPT], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    stop = reference["text"].split()[1]
    result = client.complete(PROMPT, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, num_logprobs=0,
                             stop=[stop], timeout=CALL_TIMEOUT_S)
    assert result.matched_stop_string == stop and len(result.token_ids) < MAX_TOKENS
    assert [p.sampled.token_id for p in result.logprobs] == result.token_ids
    assert all(p.top == () for p in result.logprobs)


def test_the_engine_api_sends_logprobs_without_text(engine_stub, offline, idle_engine):
    prompt_ids = offline.tokenizer.encode(PROMPT)
    request = engine_pb2.GenerateRequest(request_id="logprobs-engine", prompt_token_ids=prompt_ids,
                                         sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4,
                                                                            ignore_eos=True, num_logprobs=2))
    responses = list(engine_stub.Generate(request, timeout=CALL_TIMEOUT_S))
    ids = [i for r in responses for i in r.token_ids]
    positions = [p for r in responses for p in r.logprobs]
    assert [p.sampled.token_id for p in positions] == ids and len(ids) == 4
    assert all(len(p.top) == 2 and not p.sampled.text for p in positions)


def test_prompt_logprobs_come_through_both_services_once_with_each_tokens_text(client, offline, idle_engine):
    options = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    [reference] = offline.generate([PROMPT], num_prompt_logprobs=2, **options)
    prompt_ids = offline.tokenizer.encode(PROMPT)
    stream = client.generate(PROMPT, num_prompt_logprobs=2, timeout=CALL_TIMEOUT_S, **options)
    with stream:
        deltas = list(stream)  # all of them, so a second copy of the prompt's entries would show
        result = stream.result()
    assert len(deltas) == 3 and result.token_ids == reference["token_ids"]
    assert len(result.prompt_logprobs) == len(prompt_ids) == len(reference["prompt_logprobs"])
    assert result.prompt_logprobs[0].sampled is None and result.prompt_logprobs[0].top == ()
    decode = offline.tokenizer.decode
    expected_entries = reference["prompt_logprobs"][1:]
    for token_id, position, expected in zip(prompt_ids[1:], result.prompt_logprobs[1:], expected_entries):
        assert position.sampled.token_id == token_id
        assert position.sampled.text == decode([token_id], skip_special_tokens=False)
        assert position.sampled.logprob == pytest.approx(expected.logprob, abs=1e-4)
        assert [entry.token_id for entry in position.top] == expected.top_token_ids
        assert [entry.text for entry in position.top] == [decode([i], skip_special_tokens=False)
                                                          for i in expected.top_token_ids]
    plain = client.complete(PROMPT, timeout=CALL_TIMEOUT_S, **options)
    assert plain.prompt_logprobs == [] and plain.token_ids == result.token_ids


def test_the_engine_api_sends_prompt_logprobs_on_the_first_message_only(engine_stub, offline, idle_engine):
    prompt_ids = offline.tokenizer.encode(PROMPT)
    request = engine_pb2.GenerateRequest(request_id="prompt-logprobs-engine", prompt_token_ids=prompt_ids,
                                         sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=3,
                                                                            ignore_eos=True, num_prompt_logprobs=1))
    responses = list(engine_stub.Generate(request, timeout=CALL_TIMEOUT_S))
    first = responses[0].prompt_logprobs
    assert [len(r.prompt_logprobs) for r in responses[1:]] == [0] * (len(responses) - 1)
    assert len(first) == len(prompt_ids) and not first[0].HasField("sampled")
    assert [p.sampled.token_id for p in first[1:]] == prompt_ids[1:]
    assert all(len(p.top) == 1 and not p.sampled.text and p.sampled.logprob <= p.top[0].logprob for p in first[1:])
    assert responses[-1].usage.cached_tokens == 0


def test_penalties_come_through_both_services(client, offline, idle_engine):
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    [reference] = offline.generate([PROMPT], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **penalties)
    [plain] = offline.generate([PROMPT], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    result = client.complete(PROMPT, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=CALL_TIMEOUT_S,
                             **penalties)
    assert result.token_ids == reference["token_ids"] != plain["token_ids"]


def test_model_info_reports_the_embedded_models_card_defaults(client):
    defaults = client.model_info(timeout=CALL_TIMEOUT_S).default_sampling
    assert defaults["temperature"] == pytest.approx(0.2) and defaults["top_p"] == pytest.approx(0.9)
    assert "repetition_penalty" not in defaults  # neutral: not sent


def test_unset_sampling_takes_the_defaults_and_a_requests_own_values_win(client, offline, idle_engine):
    options = dict(seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    [cool] = offline.generate([PROMPT], temperature=0.2, top_p=0.9, **options)
    [hot] = offline.generate([PROMPT], temperature=1.5, top_p=1.0, **options)
    assert cool["token_ids"] != hot["token_ids"]
    assert client.complete(PROMPT, timeout=CALL_TIMEOUT_S, **options).token_ids == cool["token_ids"]
    assert client.complete(PROMPT, temperature=1.5, top_p=1.0, timeout=CALL_TIMEOUT_S,
                           **options).token_ids == hot["token_ids"]


@pytest.mark.parametrize("options, field", [
    (dict(num_logprobs=21), "sampling.num_logprobs"),
    (dict(num_prompt_logprobs=21), "sampling.num_prompt_logprobs"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(presence_penalty=-2.5), "sampling.presence_penalty"),
    (dict(frequency_penalty=3.0), "sampling.frequency_penalty"),
])
def test_out_of_range_values_are_invalid_argument(client, options, field):
    with pytest.raises(LLMServeError) as caught:
        client.complete(PROMPT, timeout=30, **options)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [violation.field for violation in caught.value.field_violations] == [field]

"""Structured output through both real services (embedded model): constrained completions validate and equal the
offline engine's, and an invalid constraint is INVALID_ARGUMENT naming its field before any message."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from llmserve import FinishReason, LLMServeError
from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2
from tests.services.helpers import field_violations

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "count"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Pick a color and a count. Answer in JSON."}]
MAX_TOKENS = 64
CALL_TIMEOUT_S = 120


def test_json_schema_through_the_tokenizer_service_validates_and_equals_offline(client, offline, idle_engine):
    result = client.complete(messages=CHAT, json_schema=SCHEMA, temperature=0.0, max_tokens=MAX_TOKENS,
                             timeout=CALL_TIMEOUT_S)
    assert result.finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(result.text), SCHEMA)
    reference = offline.chat(CHAT, temperature=0.0, max_tokens=MAX_TOKENS, json_schema=json.dumps(SCHEMA))
    assert result.token_ids == reference["token_ids"]


def test_regex_through_the_engine_service_matches(engine_stub, offline, idle_engine):
    regex = r"(yes|no), [a-z]{1,8}\."
    sampling = common_pb2.SamplingParams(temperature=0.7, seed=11, max_tokens=32, regex=regex)
    request = engine_pb2.GenerateRequest(request_id="structured-regex", sampling=sampling,
                                         prompt_token_ids=offline.chat_prompt_ids(CHAT))
    responses = list(engine_stub.Generate(request, timeout=CALL_TIMEOUT_S))
    token_ids = [token_id for response in responses for token_id in response.token_ids]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert re.fullmatch(regex, offline.tokenizer.decode(token_ids, skip_special_tokens=True))


@pytest.mark.parametrize("constraint, field", [
    (dict(json_schema="{not json"), "sampling.json_schema"),  # refused by the tokenizer service itself
    (dict(json_schema='{"type": 5}'), "sampling.json_schema"),  # refused by the engine's compiler, passed on
    (dict(regex="(unclosed"), "sampling.regex"),
    (dict(grammar="root ::= undefined_rule"), "sampling.grammar"),
    (dict(regex="[a-z]+", ignore_eos=True), "sampling.ignore_eos"),
], ids=str)
def test_invalid_constraint_is_invalid_argument_naming_the_field(client, idle_engine, constraint, field):
    stream = client.generate("Hello", max_tokens=8, timeout=CALL_TIMEOUT_S, **constraint)
    with pytest.raises(LLMServeError) as caught:
        next(iter(stream))  # not one message comes before the error
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert [violation.field for violation in caught.value.field_violations] == [field]


def test_engine_service_refuses_a_bad_grammar_naming_the_field(engine_stub, idle_engine):
    sampling = common_pb2.SamplingParams(max_tokens=8, grammar='root ::= "a" | ')
    request = engine_pb2.GenerateRequest(request_id="structured-bad", prompt_token_ids=[1, 2, 3], sampling=sampling)
    with pytest.raises(grpc.RpcError) as caught:
        list(engine_stub.Generate(request, timeout=CALL_TIMEOUT_S))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(caught.value) == ["sampling.grammar"]

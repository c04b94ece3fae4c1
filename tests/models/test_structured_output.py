"""Structured output on the embedded model, offline: constrained completions parse and validate, invalid
constraints are refused naming their field, a grammar is compiled once, and the mask never leaks to other rows."""

import json
import re

import jsonschema
import pytest

from services.engine.core.errors import InvalidRequestError
from services.engine.core.sampling_params import SamplingParams

# Schemas whose instances are short whatever the model does (enums, bounded integers, maxLength, maxItems), so a
# constrained completion ends on EOS well before MAX_TOKENS.
SCHEMAS = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["color", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                      "sunny": {"type": "boolean"}},
     "required": ["city"], "additionalProperties": False},
]
QUESTIONS = [
    "Pick a color and a count. Answer in JSON.",
    "Give a short name and whether it is ok, as JSON.",
    "List up to three small numbers as a JSON array.",
    "Is the sky blue? Answer yes, no or maybe, as a JSON string.",
    "Name a city and say if it is sunny there, in JSON.",
]
MAX_TOKENS = 96


def chat_ids(llm, question: str) -> list[int]:
    return llm.chat_prompt_ids([{"role": "user", "content": question}])


def test_fifty_schema_constrained_requests_all_parse_and_validate(default_llm):
    prompts, params, schemas = [], [], []
    for i in range(50):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(chat_ids(default_llm, QUESTIONS[i % len(QUESTIONS)]))
        params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS, json_schema=json.dumps(schema)))
        schemas.append(schema)
    outputs = default_llm.generate(prompts, params, use_tqdm=False)
    for output, schema in zip(outputs, schemas):
        assert output["finish_reason"] == "stop", output
        assert output["token_ids"][-1] in default_llm.eos_token_ids
        jsonschema.validate(json.loads(output["text"]), schema)
    assert len({output["text"] for output in outputs}) > len(SCHEMAS), "sampling gave no variety"


def test_greedy_json_schema_request_validates(default_llm):
    schema = SCHEMAS[0]
    [output] = default_llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, json_schema=json.dumps(schema)),
                                use_tqdm=False)
    assert output["finish_reason"] == "stop"
    jsonschema.validate(json.loads(output["text"]), schema)


def test_regex_grammar_and_json_object_constraints_hold(default_llm):
    prompt = chat_ids(default_llm, "Answer with one word: is water wet?")
    regex = r"(yes|no), [a-z]{1,8}\."
    grammar = 'root ::= "The answer is " ("42" | "seven") "."'
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=32, regex=regex),
              SamplingParams(temperature=0.8, seed=4, max_tokens=32, grammar=grammar),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, json_object=True)]
    by_regex, by_grammar, by_json = default_llm.generate([prompt] * 3, params, use_tqdm=False)
    assert re.fullmatch(regex, by_regex["text"]) and by_regex["finish_reason"] == "stop", by_regex
    assert by_grammar["text"] in ("The answer is 42.", "The answer is seven."), by_grammar
    assert by_json["finish_reason"] == "stop" and isinstance(json.loads(by_json["text"]), dict), by_json


@pytest.mark.parametrize("kind, text, words", [
    ("json_schema", '{"type": 5}', "does not compile"),
    ("regex", "(unclosed", "does not compile"),
    ("grammar", "root ::= undefined_rule", "does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused_at_admission_naming_its_field(default_llm, kind, text, words):
    with pytest.raises(InvalidRequestError) as caught:
        default_llm.engine.add_request(f"bad-{kind}", [1, 2, 3], SamplingParams(max_tokens=4, **{kind: text}))
    assert caught.value.field == f"sampling.{kind}" and words in caught.value.description
    assert "/project/cpp" not in caught.value.description  # xgrammar's C++ location is not the user's business
    assert not default_llm.engine.has_unfinished_requests()


def test_each_distinct_grammar_compiles_once(default_llm):
    compiler = default_llm.runner.grammar_masks.compiler
    regex = r"[0-9]{2}-cached"
    before = compiler.num_compiled
    params = SamplingParams(temperature=0.0, max_tokens=16, regex=regex)
    outputs = default_llm.generate([[1, 2, 3]] * 3 + [[4, 5]], params, use_tqdm=False)
    assert compiler.num_compiled == before + 1
    assert all(re.fullmatch(regex, output["text"]) for output in outputs), outputs


def test_the_mask_does_not_leak_to_unconstrained_rows(default_llm):
    """An unconstrained request batched between constrained ones decodes the same greedy ids as alone.

    The short constrained request (one enum word) finishes first, so the unconstrained one moves into its row,
    whose bitmask still holds the finished grammar's last mask (EOS only): a mask applied to every row, or to
    the wrong rows, would end it or change its tokens.
    """
    free = chat_ids(default_llm, "Write two sentences about the sea.")
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    [alone] = default_llm.generate([free], greedy, use_tqdm=False)
    short = SamplingParams(temperature=0.0, max_tokens=8, json_schema='{"enum": ["yes", "no"]}')
    long = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, json_schema=json.dumps(SCHEMAS[1]))
    constrained_prompt = chat_ids(default_llm, QUESTIONS[1])
    first, batched, last = default_llm.generate([constrained_prompt, free, constrained_prompt],
                                                [short, greedy, long], use_tqdm=False)
    assert first["text"] in ('"yes"', '"no"') and len(first["token_ids"]) < len(alone["token_ids"])
    assert batched["token_ids"] == alone["token_ids"]
    jsonschema.validate(json.loads(last["text"]), SCHEMAS[1])


def test_constrained_requests_stay_valid_through_preemption(default_llm):
    """With a KV cache too small for the batch, sequences are preempted and recomputed mid-completion."""
    small = default_llm.with_scheduler(num_kvcache_blocks=14, max_num_seqs=8)
    prompts = [chat_ids(default_llm, QUESTIONS[i % len(QUESTIONS)]) for i in range(8)]
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=MAX_TOKENS,
                             json_schema=json.dumps(SCHEMAS[i % len(SCHEMAS)])) for i in range(8)]
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0, "nothing was preempted: the cache is too big for this test"
    for i, output in enumerate(outputs):
        assert output["finish_reason"] == "stop", output
        jsonschema.validate(json.loads(output["text"]), SCHEMAS[i % len(SCHEMAS)])

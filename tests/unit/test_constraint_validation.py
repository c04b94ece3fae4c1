"""Structured-output constraints: the shared pure-Python rule (one kind at most, non-empty, JSON schema is JSON,
no ignore_eos / min_tokens) and SamplingParams.constraint, with the contract's field names."""

import pytest

from services.common.errors import InvalidRequestError
from services.common.validation import check_constraint
from services.engine.core.sampling_params import SamplingParams

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}}'


def constraint_error(**kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        check_constraint(**kwargs)
    return caught.value


@pytest.mark.parametrize("kwargs, expected", [
    (dict(), None),
    (dict(json_object=False), None),
    (dict(json_schema=SCHEMA), ("json_schema", SCHEMA)),
    (dict(json_schema="true"), ("json_schema", "true")),
    (dict(regex="[a-z]+"), ("regex", "[a-z]+")),
    (dict(grammar='root ::= "a"'), ("grammar", 'root ::= "a"')),
    (dict(json_object=True), ("json_object", "")),
], ids=str)
def test_the_constraint_is_the_one_kind_set(kwargs, expected):
    assert check_constraint(**kwargs) == expected


def test_two_kinds_are_refused_naming_the_second():
    error = constraint_error(json_schema=SCHEMA, regex="a")
    assert error.field == "sampling.regex" and "only one of" in error.description


@pytest.mark.parametrize("kwargs, field, words", [
    (dict(regex=""), "sampling.regex", "non-empty"),
    (dict(grammar="  "), "sampling.grammar", "non-empty"),
    (dict(json_schema="{not json"), "sampling.json_schema", "not valid JSON"),
    (dict(json_schema="[1, 2]"), "sampling.json_schema", "must be a JSON object"),
    (dict(regex="a", ignore_eos=True), "sampling.ignore_eos", "cannot be combined with sampling.regex"),
    (dict(json_object=True, min_tokens=1), "sampling.min_tokens", "cannot be combined with sampling.json_object"),
], ids=str)
def test_bad_constraints_name_their_field(kwargs, field, words):
    error = constraint_error(**kwargs)
    assert error.field == field and words in error.description


def test_sampling_params_carry_the_checked_constraint():
    assert SamplingParams().constraint is None
    assert SamplingParams(regex="[0-9]").constraint == ("regex", "[0-9]")
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(json_schema="{", max_tokens=8)
    assert caught.value.field == "sampling.json_schema"


def test_a_refusal_survives_the_pickled_trip_from_the_engine_core_to_a_front():
    """The core compiles grammars and sends an InvalidRequestError back pickled (serving/messages.AddRejected)."""
    from services.engine.serving.messages import AddRejected, decode, encode

    message = decode(encode(AddRejected(7, InvalidRequestError("sampling.regex", "does not compile: x"))))
    assert (message.error.field, message.error.description) == ("sampling.regex", "does not compile: x")

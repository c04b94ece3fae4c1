"""services.common.validation: every range boundary, with the contract's field name and what it says."""

import math

import pytest

from services.common.errors import InvalidRequestError
from services.common.validation import (
    MAX_LOGPROBS, check_extras, check_fits, check_prompt, check_sampling, check_token_ids, check_wire_sampling)

GOOD = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=16, min_tokens=0, seed=None)


def sampling_error(**changes) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        check_sampling(**{**GOOD, **changes})
    return caught.value


@pytest.mark.parametrize("changes", [
    dict(temperature=0.0), dict(temperature=1e6), dict(top_k=-1), dict(top_k=0), dict(top_k=1),
    dict(top_p=1.0), dict(top_p=1e-9), dict(min_p=0.0), dict(min_p=0.999), dict(max_tokens=1),
    dict(min_tokens=16), dict(min_tokens=0), dict(seed=0), dict(seed=2**64 - 1),
], ids=str)
def test_values_at_the_edge_of_their_range_pass(changes):
    check_sampling(**{**GOOD, **changes})


@pytest.mark.parametrize("changes, field, description", [
    (dict(temperature=-1e-9), "sampling.temperature", "must be a finite number >= 0, got -1e-09"),
    (dict(temperature=math.inf), "sampling.temperature", "must be a finite number >= 0, got inf"),
    (dict(temperature=math.nan), "sampling.temperature", "must be a finite number >= 0, got nan"),
    (dict(top_k=-2), "sampling.top_k", "must be >= 1, or 0 / -1 to disable top-k, got -2"),
    (dict(top_p=0.0), "sampling.top_p", "must be in (0, 1], got 0.0"),
    (dict(top_p=1.0000001), "sampling.top_p", "must be in (0, 1], got 1.0000001"),
    (dict(top_p=math.nan), "sampling.top_p", "must be in (0, 1], got nan"),
    (dict(min_p=1.0), "sampling.min_p", "must be in [0, 1), got 1.0"),
    (dict(min_p=-1e-9), "sampling.min_p", "must be in [0, 1), got -1e-09"),
    (dict(min_p=math.nan), "sampling.min_p", "must be in [0, 1), got nan"),
    (dict(max_tokens=0), "sampling.max_tokens", "must be >= 1, got 0"),
    (dict(min_tokens=17), "sampling.min_tokens", "must be in [0, max_tokens=16], got 17"),
    (dict(min_tokens=-1), "sampling.min_tokens", "must be in [0, max_tokens=16], got -1"),
    (dict(seed=-1), "sampling.seed", "must be >= 0, got -1"),
], ids=lambda value: str(value) if isinstance(value, dict) else None)
def test_each_value_out_of_range_names_its_contract_field(changes, field, description):
    error = sampling_error(**changes)
    assert (error.field, error.description) == (field, description)
    assert str(error) == f"{field}: {description}"


def test_the_first_bad_field_is_reported():
    assert sampling_error(temperature=-1.0, top_p=0.0).field == "sampling.temperature"


def test_wire_only_checks():
    check_wire_sampling(top_k=None)
    check_wire_sampling(top_k=1)
    with pytest.raises(InvalidRequestError) as caught:
        check_wire_sampling(top_k=0)
    assert (caught.value.field, caught.value.description) == (
        "sampling.top_k", "must be >= 1 (leave it unset to disable top-k)")


def _extras_error(**overrides) -> InvalidRequestError:
    values = dict(num_logprobs=None, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    values.update(overrides)
    with pytest.raises(InvalidRequestError) as caught:
        check_extras(**values)
    return caught.value


@pytest.mark.parametrize("value", [0, 5, MAX_LOGPROBS])
def test_num_logprobs_up_to_the_limit_is_accepted(value):
    check_extras(num_logprobs=value, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                 num_prompt_logprobs=value)


@pytest.mark.parametrize("overrides, field", [
    (dict(num_logprobs=MAX_LOGPROBS + 1), "sampling.num_logprobs"),
    (dict(num_logprobs=-1), "sampling.num_logprobs"),
    (dict(num_prompt_logprobs=MAX_LOGPROBS + 1), "sampling.num_prompt_logprobs"),
    (dict(num_prompt_logprobs=-1), "sampling.num_prompt_logprobs"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "sampling.repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "sampling.repetition_penalty"),
    (dict(presence_penalty=2.01), "sampling.presence_penalty"),
    (dict(presence_penalty=float("nan")), "sampling.presence_penalty"),
    (dict(frequency_penalty=-2.01), "sampling.frequency_penalty"),
])
def test_logprob_and_penalty_ranges(overrides, field):
    assert _extras_error(**overrides).field == field


def test_penalty_bounds_are_inclusive():
    check_extras(num_logprobs=None, repetition_penalty=0.01, presence_penalty=-2.0, frequency_penalty=2.0)


def test_token_ids_must_be_in_the_vocabulary():
    check_token_ids("f", [0, 9], 10)
    check_token_ids("f", [], 10)
    for bad in (10, -1):
        with pytest.raises(InvalidRequestError) as caught:
            check_token_ids("token_ids.ids", [3, bad, 4], 10)
        assert (caught.value.field, caught.value.description) == (
            "token_ids.ids", f"token id {bad} is not in [0, vocab_size=10)")


def test_prompt_must_be_non_empty_in_vocab_and_fit():
    check_prompt("prompt_token_ids", [1] * 8, vocab_size=10, max_model_len=8)
    cases = [([], "must not be empty"), ([1, 10], "token id 10 is not in [0, vocab_size=10)"),
             ([1] * 9, "the prompt has 9 tokens; max_model_len is 8")]
    for ids, description in cases:
        with pytest.raises(InvalidRequestError) as caught:
            check_prompt("text", ids, vocab_size=10, max_model_len=8)
        assert (caught.value.field, caught.value.description) == ("text", description)


def test_prompt_plus_max_tokens_must_fit_in_the_context():
    check_fits(num_prompt_tokens=6, max_tokens=2, max_model_len=8)
    with pytest.raises(InvalidRequestError) as caught:
        check_fits(num_prompt_tokens=6, max_tokens=3, max_model_len=8)
    assert caught.value.field == "sampling.max_tokens"
    assert caught.value.description == "prompt (6) + max_tokens (3) exceeds max_model_len 8"


def test_sampling_params_validate_with_the_same_checks_and_change_nothing():
    from services.engine.core.sampling_params import SamplingParams

    params = SamplingParams(top_k=-1, temperature=0.0, seed=3)
    params.validate()
    assert (params.top_k, params.temperature, params.seed) == (-1, 0.0, 3)
    for changes, field in ((dict(temperature=math.inf), "sampling.temperature"), (dict(seed=-1), "sampling.seed"),
                           (dict(min_tokens=17), "sampling.min_tokens"), (dict(top_k=-2), "sampling.top_k")):
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(**changes)
        assert caught.value.field == field


def test_a_refused_huge_request_id_is_logged_short():
    from services.common.validation import MAX_REQUEST_ID_LEN, loggable_request_id

    exact = "a" * MAX_REQUEST_ID_LEN
    assert loggable_request_id(exact) == exact
    huge = loggable_request_id("b" * 8_000_000)
    assert huge.startswith("b" * MAX_REQUEST_ID_LEN + "...") and huge.endswith("(8000000 characters)")
    assert len(huge) < MAX_REQUEST_ID_LEN + 40


def test_a_request_id_character_passes_exactly_when_it_is_printable_ascii():
    """Every code point of the first planes, and a few beyond: the fast path and the scan agree with the rule."""
    from services.common.errors import InvalidRequestError
    from services.common.validation import check_request_id

    refused = []
    for code in [*range(0x3000), 0xFEFF, 0x1F600, 0xE0001, 0x10FFFF]:
        try:
            check_request_id(f"id-{chr(code)}")
        except InvalidRequestError as error:
            assert error.field == "request_id" and "at index 3" in error.description
            refused.append(code)
    assert refused == [code for code in [*range(0x3000), 0xFEFF, 0x1F600, 0xE0001, 0x10FFFF]
                       if not 0x20 <= code <= 0x7E]

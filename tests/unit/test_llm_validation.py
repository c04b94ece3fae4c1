"""The offline LLM rejects bad input with InvalidRequestError and the contract's field names, like the services."""

import itertools

import pytest

from services.engine.core.errors import InvalidRequestError
from services.engine.core.sampling_params import SamplingParams
from services.common.generation_defaults import sampling_defaults
from services.engine.llm import LLM
from tests.unit.test_engine_core import VOCAB_SIZE, ScriptedRunner, make_engine


def offline_llm() -> LLM:
    """An LLM over the scripted runner, without a tokenizer (so without loading a model)."""
    llm = object.__new__(LLM)
    llm.tokenizer = None
    llm.engine = make_engine(ScriptedRunner())
    llm._request_ids = itertools.count()
    llm.generation_defaults = sampling_defaults("scripted", None)
    return llm


def rejected_field(prompts, sampling_params=None) -> str:
    llm = offline_llm()
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate(prompts, sampling_params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # all or nothing: none of the batch was left behind
    return caught.value.field


def test_token_id_prompts_generate():
    [result] = offline_llm().generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(result["token_ids"]) == 2 and result["finish_reason"] == "length"


@pytest.mark.parametrize("prompts, sampling_params, field", [
    ("some text", None, "prompts"),  # no tokenizer: token ids only
    ([], None, "prompts"),
    ([[5, 6], "text"], None, "prompts"),
    ([[5, 6], [7, "x"]], None, "prompts"),
    ([[5, 6], []], None, "prompt_token_ids"),
    ([[5, 6], [7, VOCAB_SIZE]], None, "prompt_token_ids"),
    ([[5, 6], [7]], [SamplingParams()], "sampling_params"),
    ([[5, 6]], [{"temperature": 0.0}], "sampling_params"),
    ([[5, 6]], SamplingParams(max_tokens=63), "sampling.max_tokens"),
    ([[5, 6]], SamplingParams(stop_token_ids=[VOCAB_SIZE]), "sampling.stop_token_ids"),
], ids=str)
def test_bad_input_raises_invalid_request_with_the_field(prompts, sampling_params, field):
    assert rejected_field(prompts, sampling_params) == field


def test_sampling_values_are_checked_when_built_and_when_submitted():
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(temperature=float("inf"))
    assert caught.value.field == "sampling.temperature"
    changed = SamplingParams()
    changed.top_p = 0.0  # mutable after construction: checked again on submission
    assert rejected_field([[5, 6], [7, 8]], [SamplingParams(), changed]) == "sampling.top_p"


def test_chat_without_a_tokenizer_is_an_invalid_request():
    with pytest.raises(InvalidRequestError) as caught:
        offline_llm().chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert caught.value.field == "messages"

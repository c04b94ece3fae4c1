"""The public request -> engine request conversion, without a server: defaults, and every rejection's status,
field and meaning (as the one interceptor would send it)."""

import math
import re

import pytest
from google.rpc import code_pb2, error_details_pb2

from llmserve.common.v1 import common_pb2
from llmserve.textgen.v1 import textgen_pb2
from services.common.errors import InvalidRequestError
from services.common.grpc_server import status_for
from services.tokenizer.serving.convert import prompt_ids, resolve_generate, resolve_sampling

VOCAB_SIZE = 100
MAX_MODEL_LEN = 32
DEFAULT_MAX_TOKENS = 8


BOS = 99


class WordTokenizer:
    """One token per word (its length), BOS first when special tokens are added; chat: the user messages' words."""

    vocab_size = VOCAB_SIZE

    def __init__(self, defaults: dict | None = None):
        self.defaults = defaults or {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "min_p": 0.0}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BOS] * (add_special_tokens is True) + [len(word) for word in text.split()]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return [token for m in messages if m["role"] == "user" for token in self.encode(m["content"], False)]

    def generation_defaults(self) -> dict:
        return dict(self.defaults)


def generate_request(text: str | None = "a bb ccc", token_ids: list[int] | None = None, stop=(),
                     **sampling) -> textgen_pb2.GenerateRequest:
    request = textgen_pb2.GenerateRequest(stop=list(stop))
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    elif text is not None:
        request.text = text
    for name, value in sampling.items():
        if name == "stop_token_ids":
            request.sampling.stop_token_ids.extend(value)
        else:
            setattr(request.sampling, name, value)
    return request


def resolve(request: textgen_pb2.GenerateRequest, tokenizer=None):
    return resolve_generate(request, "req", tokenizer or WordTokenizer(), MAX_MODEL_LEN, DEFAULT_MAX_TOKENS)


def rejection(request: textgen_pb2.GenerateRequest) -> tuple[str, str]:
    """(field, description) of the single BadRequest violation in the INVALID_ARGUMENT status sent back."""
    with pytest.raises(InvalidRequestError) as caught:
        resolve(request)
    status = status_for(caught.value)
    assert status.code == code_pb2.INVALID_ARGUMENT
    [detail] = status.details
    bad_request = error_details_pb2.BadRequest()
    assert detail.Unpack(bad_request)
    [violation] = bad_request.field_violations
    assert status.message == f"{violation.field}: {violation.description}"
    return violation.field, violation.description


@pytest.mark.parametrize("request_args, field, says", [
    (dict(text=""), "text", "must not be empty"),
    (dict(text=None), "prompt", "set one of text, chat or token_ids"),
    (dict(token_ids=[]), "token_ids.ids", "must not be empty"),
    (dict(token_ids=[1, VOCAB_SIZE]), "token_ids.ids", f"token id {VOCAB_SIZE} "),
    (dict(text="w " * MAX_MODEL_LEN), "text", f"{MAX_MODEL_LEN + 1} tokens; max_model_len is {MAX_MODEL_LEN}"),
    (dict(token_ids=[1] * (MAX_MODEL_LEN + 1)), "token_ids.ids", "max_model_len"),
    (dict(temperature=-0.5), "sampling.temperature", ">= 0"),
    (dict(temperature=math.inf), "sampling.temperature", "finite"),
    (dict(temperature=math.nan), "sampling.temperature", "finite"),
    (dict(top_p=0.0), "sampling.top_p", "(0, 1]"),
    (dict(top_p=1.5), "sampling.top_p", "(0, 1]"),
    (dict(top_k=0), "sampling.top_k", "unset to disable"),
    (dict(min_p=1.0), "sampling.min_p", "[0, 1)"),
    (dict(max_tokens=0), "sampling.max_tokens", ">= 1"),
    (dict(max_tokens=MAX_MODEL_LEN - 3), "sampling.max_tokens", "prompt (4) + max_tokens (29) exceeds"),
    (dict(min_tokens=5, max_tokens=4), "sampling.min_tokens", "max_tokens=4"),
    (dict(stop_token_ids=[5, VOCAB_SIZE]), "sampling.stop_token_ids", f"token id {VOCAB_SIZE} "),
    (dict(num_logprobs=21), "sampling.num_logprobs", "[0, 20]"),
    (dict(num_prompt_logprobs=21), "sampling.num_prompt_logprobs", "[0, 20]"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty", "> 0"),
    (dict(presence_penalty=2.5), "sampling.presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-3.0), "sampling.frequency_penalty", "[-2, 2]"),
    (dict(stop=["ok", ""]), "stop[1]", "must not be empty"),
], ids=lambda value: repr(value)[:60] if isinstance(value, dict) else None)
def test_rejection_names_the_contract_field(request_args, field, says):
    got_field, description = rejection(generate_request(**request_args))
    assert got_field == field
    assert says in description
    if says.startswith(("must not", "set one")):
        assert description == says


def test_a_chat_prompt_longer_than_max_model_len_names_chat():
    request = textgen_pb2.GenerateRequest()
    for _ in range(MAX_MODEL_LEN + 1):
        request.chat.messages.add(role="user", content="hi")
    assert rejection(request)[0] == "chat"


def test_prompts_become_token_ids():
    chat = textgen_pb2.GenerateRequest()
    chat.chat.messages.add(role="system", content="be brief")
    chat.chat.messages.add(role="user", content="a bb")
    assert resolve(chat).prompt_ids == [1, 2] and resolve(chat).prompt_field == "chat"
    assert resolve(generate_request("a bb ccc")).prompt_ids == [BOS, 1, 2, 3]
    tokenize = textgen_pb2.TokenizeRequest(text="a bb")
    assert prompt_ids(tokenize, WordTokenizer()) == ("text", [BOS, 1, 2])
    assert prompt_ids(tokenize, WordTokenizer(), add_special_tokens=False) == ("text", [1, 2])


def test_the_prompt_and_max_tokens_may_fill_the_context_exactly():
    resolved = resolve(generate_request(max_tokens=MAX_MODEL_LEN - 4))
    assert resolved.sampling.max_tokens == MAX_MODEL_LEN - 4
    resolved = resolve(generate_request(token_ids=[1] * (MAX_MODEL_LEN - 1), max_tokens=1))
    assert resolved.prompt_field == "token_ids.ids" and len(resolved.prompt_ids) == MAX_MODEL_LEN - 1


def test_unset_fields_take_the_models_generation_defaults():
    tokenizer = WordTokenizer({"temperature": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.05})
    resolved = resolve(generate_request(), tokenizer)
    sampling = resolved.sampling
    assert (sampling.temperature, sampling.top_k, sampling.max_tokens) == (pytest.approx(0.6), 40, DEFAULT_MAX_TOKENS)
    assert (sampling.top_p, sampling.min_p) == (pytest.approx(0.9), pytest.approx(0.05))
    assert not sampling.HasField("seed") and not sampling.HasField("min_tokens")
    assert resolved.prompt_field == "text" and resolved.prompt_ids == [BOS, 1, 2, 3]
    assert resolved.skip_special_tokens is True and resolved.include_stop_str_in_output is False
    request = generate_request()
    request.skip_special_tokens, request.include_stop_str_in_output = False, True
    resolved = resolve(request, tokenizer)
    assert resolved.skip_special_tokens is False and resolved.include_stop_str_in_output is True


def test_set_fields_win_over_the_defaults():
    request = generate_request(temperature=0.0, top_p=0.5, top_k=3, min_p=0.25, max_tokens=2, seed=7)
    sampling = resolve(request, WordTokenizer({"temperature": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.05})).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (0.0, 0.5, 3, 0.25)
    assert (sampling.max_tokens, sampling.seed) == (2, 7)


def test_a_repetition_penalty_default_applies_unless_the_request_sets_one():
    tokenizer = WordTokenizer({"temperature": 0.6, "repetition_penalty": 1.2})
    assert resolve(generate_request(), tokenizer).sampling.repetition_penalty == pytest.approx(1.2)
    sampling = resolve(generate_request(repetition_penalty=1.0, presence_penalty=0.5), tokenizer).sampling
    assert (sampling.repetition_penalty, sampling.presence_penalty) == (1.0, 0.5)
    assert not resolve(generate_request(), WordTokenizer()).sampling.HasField("repetition_penalty")


def test_logprobs_and_penalties_pass_through():
    sampling = resolve(generate_request(num_logprobs=20, frequency_penalty=-2.0, num_prompt_logprobs=0)).sampling
    assert (sampling.num_logprobs, sampling.frequency_penalty, sampling.num_prompt_logprobs) == (20, -2.0, 0)


def test_without_model_defaults_unset_fields_are_neutral():
    sampling = resolve_sampling(common_pb2.SamplingParams(), {}, 3, MAX_MODEL_LEN, DEFAULT_MAX_TOKENS, VOCAB_SIZE)
    assert (sampling.temperature, sampling.top_p, sampling.min_p, sampling.top_k) == (1.0, 1.0, 0.0, 0)
    assert not sampling.HasField("top_k")


def test_default_max_tokens_is_capped_by_the_room_left():
    sampling = resolve_sampling(common_pb2.SamplingParams(), {}, MAX_MODEL_LEN - 5, MAX_MODEL_LEN, 8, VOCAB_SIZE)
    assert sampling.max_tokens == 5
    sampling = resolve_sampling(common_pb2.SamplingParams(), {}, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 8, VOCAB_SIZE)
    assert sampling.max_tokens == 1


def test_engine_request_ids_are_unique_and_carry_the_callers_id():
    resolved = resolve(generate_request(stop=["x", "x", "y"]))
    assert resolved.stops == ["x", "y"]
    first, second = resolved.engine_request(), resolved.engine_request()
    assert re.fullmatch(r"req-[0-9a-f]{12}", first.request_id) and first.request_id != second.request_id
    assert list(first.prompt_token_ids) == [BOS, 1, 2, 3] and first.sampling == resolved.sampling

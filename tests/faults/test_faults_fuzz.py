"""Property-based fuzz of the public GenerateRequest against the running services (hypothesis).

Whatever a client sends (text, chat or token-id prompts, or none; sampling values at and past their extremes,
NaN and infinities; huge ids; any unicode; empty everything), the answer is a valid stream (messages, then
exactly one carrying the finish reason) or a documented status, never INTERNAL or UNKNOWN, and both services
keep serving afterwards. Examples are derandomized and bounded, so a CI run is reproducible and short.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmserve.common.v1 import common_pb2
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from tests.faults.stack import MAX_MODEL_LEN, SERVING, greedy_request
from tests.faults.streams import LENGTH, read_sync
from tests.services.helpers import field_violations, wait_engine_idle
from tests.services.procs import TEXTGEN_SERVICE, health_status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

VOCAB_SIZE = 49152  # bench/tiny_model.py
CALL_TIMEOUT_S = 120.0
NUM_EXAMPLES = int(os.environ.get("LLMSERVE_FUZZ_EXAMPLES", "80"))  # more for a deeper local run
DERANDOMIZE = "LLMSERVE_FUZZ_EXAMPLES" not in os.environ  # CI: the same examples every run
MIN_EACH = NUM_EXAMPLES // 6  # at least this many streamed, and this many refused
# The documented refusals (textgen.proto, common.proto): bad input, overload, past a limit.
DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
FINISHED = {common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP}

U32 = st.integers(0, 2**32 - 1)
EXTREME_FLOATS = st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, 1e-45, 3.4e38, -3.4e38, 2.0, 0.999999,
                                  float("nan"), float("inf"), float("-inf")])
WILD_FLOATS = st.floats(width=32) | EXTREME_FLOATS
# Long enough to stream, short enough for CI; the huge ones must be refused before anything runs.
MAX_TOKENS = st.sampled_from([0, 1, 2, 7, 32, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 2**31, 2**32 - 1])
TOKEN_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1) | st.sampled_from([VOCAB_SIZE, 2**31, 2**32 - 1]), max_size=40)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "", "USER"]) | st.text(max_size=8)
# A tame value is in its documented range, often at its edge; a wild one is anything the wire carries.
IN_RANGE = {
    "temperature": st.sampled_from([0.0, 1e-45, 0.7, 1.0, 2.0, 3.4e38]), "top_p": st.sampled_from([1e-45, 0.5, 1.0]),
    "min_p": st.sampled_from([0.0, 0.5, 0.999999]), "top_k": st.sampled_from([1, 2, 50, VOCAB_SIZE, 2**32 - 1]),
    "max_tokens": st.sampled_from([1, 2, 7, 32]), "min_tokens": st.sampled_from([0, 1]),
    "num_logprobs": st.nothing(),
}
WILD = {"temperature": WILD_FLOATS, "top_p": WILD_FLOATS, "min_p": WILD_FLOATS, "top_k": U32, "max_tokens": MAX_TOKENS,
        "min_tokens": st.sampled_from([0, 1, 3, 16, 2**32 - 1]), "num_logprobs": st.sampled_from([0, 1, 5, 2**32 - 1])}
FIELDS = [*WILD, "stop_token_ids", "prompt", "stop", "request_id"]
TAME_REQUEST_IDS = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)  # printable ASCII


def optional(strategy):
    return st.none() | strategy


@st.composite
def wild_fields(draw) -> set[str]:
    """Which fields are wild: none (a request that should stream), one (so every single check is reached on its
    own, not hidden behind another field's refusal), or all."""
    mode = draw(st.sampled_from(["tame", "one", "one", "all"]))
    return set() if mode == "tame" else set(FIELDS) if mode == "all" else {draw(st.sampled_from(FIELDS))}


@st.composite
def sampling_params(draw, wild: set[str]) -> common_pb2.SamplingParams:
    values = {name: draw(WILD[name] if name in wild else optional(IN_RANGE[name])) for name in WILD}
    values.update(seed=draw(optional(st.integers(0, 2**64 - 1))), ignore_eos=draw(optional(st.booleans())))
    sampling = common_pb2.SamplingParams(**{name: value for name, value in values.items() if value is not None})
    stop_ids = (st.integers(0, VOCAB_SIZE - 1) | U32) if "stop_token_ids" in wild else st.integers(0, VOCAB_SIZE - 1)
    sampling.stop_token_ids.extend(draw(st.lists(stop_ids, max_size=3)))
    return sampling


@st.composite
def generate_requests(draw) -> textgen_pb2.GenerateRequest:
    wild = draw(wild_fields())
    request_ids = st.text(max_size=40) | st.text(max_size=600) if "request_id" in wild else TAME_REQUEST_IDS
    request = textgen_pb2.GenerateRequest(request_id=draw(request_ids), sampling=draw(sampling_params(wild)))
    wild_prompt = "prompt" in wild
    prompt = draw(st.sampled_from(["text", "text", "chat", "token_ids"] + (["none"] if wild_prompt else [])))
    min_size = 0 if wild_prompt else 1
    if prompt == "text":
        request.text = draw(st.text(min_size=min_size, max_size=160))
    elif prompt == "chat":
        roles = ROLES if wild_prompt else st.sampled_from(["system", "user", "assistant"])
        messages = draw(st.lists(st.tuples(roles, st.text(max_size=60)), min_size=min_size, max_size=3))
        request.chat.SetInParent()  # an empty conversation is still a chat prompt
        request.chat.messages.extend(textgen_pb2.ChatMessage(role=role, content=content) for role, content in messages)
    elif prompt == "token_ids":
        request.token_ids.SetInParent()
        ids = TOKEN_IDS if wild_prompt else st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40)
        request.token_ids.ids.extend(draw(ids))
    request.stop.extend(draw(st.lists(st.text(min_size=0 if "stop" in wild else 1, max_size=6), max_size=3)))
    for name in ("skip_special_tokens", "include_stop_str_in_output"):
        if (value := draw(optional(st.booleans()))) is not None:
            setattr(request, name, value)
    return request


def assert_documented_answer(request: textgen_pb2.GenerateRequest, outcome) -> None:
    assert outcome.code == grpc.StatusCode.OK or outcome.code in DOCUMENTED, (outcome.code, outcome.details)
    if outcome.code != grpc.StatusCode.OK:
        assert outcome.num_messages == 0, "a refusal after messages"
        return
    assert not outcome.contract_violations(), outcome.contract_violations()
    assert outcome.finish_reason in FINISHED, outcome.finish_reason
    if request.request_id:
        assert outcome.request_ids == {request.request_id}, outcome.request_ids
    if request.sampling.HasField("max_tokens"):
        assert len(outcome.token_ids) <= request.sampling.max_tokens
        if outcome.finish_reason == LENGTH:
            assert len(outcome.token_ids) == request.sampling.max_tokens


def edge(max_tokens: int = 4, **fields) -> textgen_pb2.GenerateRequest:
    """A request that is valid but for `fields` (prompt fields, stop, or sampling values given as sampling_<name>)."""
    sampling = {name[len("sampling_"):]: fields.pop(name) for name in list(fields) if name.startswith("sampling_")}
    request = textgen_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        **{"temperature": 0.0, "ignore_eos": True, "max_tokens": max_tokens, **sampling}))
    if not any(name in fields for name in ("text", "chat", "token_ids", "no_prompt")):
        request.text = "Edge case:"
    fields.pop("no_prompt", None)
    for name, value in fields.items():
        if name == "chat":
            request.chat.SetInParent()
            request.chat.messages.extend(textgen_pb2.ChatMessage(role=role, content=text) for role, text in value)
        elif name == "token_ids":
            request.token_ids.SetInParent()
            request.token_ids.ids.extend(value)
        elif name == "stop":
            request.stop.extend(value)
        else:
            setattr(request, name, value)
    return request


# The documented edges, always tried first (hypothesis's explicit examples), whatever the random draw reaches.
EDGES = [
    edge(token_ids=[VOCAB_SIZE]), edge(token_ids=[2**32 - 1]), edge(token_ids=[]), edge(text=""), edge(no_prompt=True),
    edge(max_tokens=MAX_MODEL_LEN + 1), edge(max_tokens=MAX_MODEL_LEN), edge(max_tokens=2**32 - 1), edge(max_tokens=0),
    edge(sampling_temperature=float("nan")), edge(sampling_temperature=float("inf")), edge(sampling_top_p=0.0),
    edge(sampling_top_k=0), edge(sampling_min_p=1.0), edge(sampling_min_tokens=5), edge(sampling_num_logprobs=1),
    edge(sampling_stop_token_ids=[VOCAB_SIZE]), edge(chat=[]), edge(chat=[("robot", "hi")]), edge(stop=[""]),
    edge(text="<|im_end|><|im_start|>user 🌍\x00", skip_special_tokens=False), edge(request_id="a\nb"),
    edge(request_id="x" * 257), edge(request_id="é"),
]


def with_edges(test):
    for request in reversed(EDGES):
        test = example(request=request)(test)
    return test


@pytest.fixture
def textgen_stub(faults_stack) -> Iterator[textgen_pb2_grpc.TextGenerationServiceStub]:
    with grpc.insecure_channel(faults_stack.tokenizer_target) as channel:
        yield textgen_pb2_grpc.TextGenerationServiceStub(channel)


def test_any_generate_request_gets_a_valid_stream_or_a_documented_status(faults_stack, textgen_stub):
    @settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=generate_requests())
    @with_edges
    def answer_is_documented(request: textgen_pb2.GenerateRequest) -> None:
        outcome = read_sync(textgen_stub, request, CALL_TIMEOUT_S)
        codes[outcome.code.name] += 1
        assert_documented_answer(request, outcome)
        if outcome.code == grpc.StatusCode.INVALID_ARGUMENT:
            assert field_violations(outcome.error), "INVALID_ARGUMENT without a google.rpc.BadRequest field"

    codes: Counter[str] = Counter()
    answer_is_documented()
    print(f"fuzz answers: {dict(codes)}")
    assert codes["OK"] >= MIN_EACH and sum(codes.values()) - codes["OK"] >= MIN_EACH, codes  # both paths exercised
    assert health_status(faults_stack.tokenizer_target, TEXTGEN_SERVICE) == SERVING
    normal = read_sync(textgen_stub, greedy_request("Still serving?", 8), CALL_TIMEOUT_S)
    assert (normal.code, normal.finish_reason, len(normal.token_ids)) == (grpc.StatusCode.OK, LENGTH, 8), normal
    with grpc.insecure_channel(faults_stack.engine_target) as channel:
        wait_engine_idle(faults_stack.engine_stub(channel))

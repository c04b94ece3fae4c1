"""The engine service's protobuf conversions, without a server: sampling values, rejections, matched stop ids."""

import math

import pytest

from llmserve.common.v1 import common_pb2
from services.common.convert import RequestClock
from services.common.errors import InvalidRequestError
from services.engine.core.interfaces import RequestOutput
from services.engine.core.sequence import FinishReason
from services.engine.serving.convert import response_from_output, sampling_from_proto

MAX_MODEL_LEN = 64


def test_unset_fields_are_neutral_and_max_tokens_fills_the_context():
    sampling = sampling_from_proto(common_pb2.SamplingParams(), num_prompt_tokens=10, max_model_len=MAX_MODEL_LEN)
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (1.0, 0, 1.0, 0.0)
    assert (sampling.seed, sampling.max_tokens, sampling.min_tokens, sampling.ignore_eos) == (None, 54, 0, False)
    assert sampling.stop_token_ids == []
    assert sampling_from_proto(common_pb2.SamplingParams(), MAX_MODEL_LEN + 5, MAX_MODEL_LEN).max_tokens == 1


def test_set_fields_are_kept():
    proto = common_pb2.SamplingParams(temperature=0.5, top_k=4, top_p=0.75, min_p=0.125, seed=9, max_tokens=7,
                                      min_tokens=2, ignore_eos=True, stop_token_ids=[5, 6])
    sampling = sampling_from_proto(proto, 10, MAX_MODEL_LEN)
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (0.5, 4, 0.75, 0.125)
    assert (sampling.seed, sampling.max_tokens, sampling.min_tokens, sampling.ignore_eos) == (9, 7, 2, True)
    assert sampling.stop_token_ids == [5, 6]


@pytest.mark.parametrize("fields, field", [
    (dict(temperature=math.inf), "sampling.temperature"),
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(top_k=0), "sampling.top_k"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(min_p=1.0), "sampling.min_p"),
    (dict(max_tokens=0), "sampling.max_tokens"),
    (dict(max_tokens=3, min_tokens=4), "sampling.min_tokens"),
    (dict(num_logprobs=2), "sampling.num_logprobs"),
], ids=str)
def test_out_of_range_values_name_the_contract_field(fields, field):
    with pytest.raises(InvalidRequestError) as caught:
        sampling_from_proto(common_pb2.SamplingParams(**fields), 10, MAX_MODEL_LEN)
    assert caught.value.field == field


def output(finish_reason, new_token_ids=(), matched=None) -> RequestOutput:
    return RequestOutput("r", list(new_token_ids), finish_reason, 3, 2, 0, matched_stop_token_id=matched)


def test_matched_stop_token_id_is_passed_on_only_for_a_stop():
    clock = RequestClock()
    stopped = response_from_output(output(FinishReason.STOP, [7, 2], matched=2), clock)
    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP and stopped.matched_stop_token_id == 2
    for finish_reason in (None, FinishReason.LENGTH, FinishReason.ABORTED):
        response = response_from_output(output(finish_reason, [7]), clock)
        assert not response.HasField("matched_stop_token_id"), finish_reason
    assert response_from_output(output(None, [7]), clock).finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED

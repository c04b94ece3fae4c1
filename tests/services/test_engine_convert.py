"""The engine service's protobuf conversions, without a server: sampling values, rejections, matched stop ids."""

import math

import pytest

from llmserve.common.v1 import common_pb2
from services.common.convert import RequestClock
from services.common.errors import InvalidRequestError
from services.engine.core.interfaces import PromptLogprobs, RequestOutput
from services.engine.core.sequence import FinishReason
from services.engine.serving.convert import response_from_output, sampling_from_proto

MAX_MODEL_LEN = 64


def test_unset_fields_are_neutral_and_max_tokens_fills_the_context():
    sampling = sampling_from_proto(common_pb2.SamplingParams(), num_prompt_tokens=10, max_model_len=MAX_MODEL_LEN)
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (1.0, 0, 1.0, 0.0)
    assert (sampling.seed, sampling.max_tokens, sampling.min_tokens, sampling.ignore_eos) == (None, 54, 0, False)
    assert sampling.stop_token_ids == []
    assert (sampling.num_logprobs, sampling.repetition_penalty, sampling.presence_penalty,
            sampling.frequency_penalty) == (None, 1.0, 0.0, 0.0)
    with pytest.raises(InvalidRequestError) as error:  # no room and max_tokens unset: the prompt is to blame
        sampling_from_proto(common_pb2.SamplingParams(), MAX_MODEL_LEN + 5, MAX_MODEL_LEN)
    assert error.value.field == "prompt_token_ids"


def test_set_fields_are_kept():
    proto = common_pb2.SamplingParams(temperature=0.5, top_k=4, top_p=0.75, min_p=0.125, seed=9, max_tokens=7,
                                      min_tokens=2, ignore_eos=True, stop_token_ids=[5, 6], num_logprobs=0,
                                      repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=0.75,
                                      num_prompt_logprobs=3)
    sampling = sampling_from_proto(proto, 10, MAX_MODEL_LEN)
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (0.5, 4, 0.75, 0.125)
    assert (sampling.seed, sampling.max_tokens, sampling.min_tokens, sampling.ignore_eos) == (9, 7, 2, True)
    assert sampling.stop_token_ids == [5, 6]
    assert (sampling.num_logprobs, sampling.repetition_penalty, sampling.presence_penalty,
            sampling.frequency_penalty) == (0, 1.25, -0.5, 0.75)
    assert sampling.num_prompt_logprobs == 3
    assert sampling_from_proto(common_pb2.SamplingParams(), 10, MAX_MODEL_LEN).num_prompt_logprobs is None


@pytest.mark.parametrize("fields, field", [
    (dict(temperature=math.inf), "sampling.temperature"),
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(top_k=0), "sampling.top_k"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(min_p=1.0), "sampling.min_p"),
    (dict(max_tokens=0), "sampling.max_tokens"),
    (dict(max_tokens=3, min_tokens=4), "sampling.min_tokens"),
    (dict(num_logprobs=21), "sampling.num_logprobs"),
    (dict(num_prompt_logprobs=21), "sampling.num_prompt_logprobs"),
    (dict(repetition_penalty=-1.0), "sampling.repetition_penalty"),
    (dict(presence_penalty=2.5), "sampling.presence_penalty"),
    (dict(frequency_penalty=math.nan), "sampling.frequency_penalty"),
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


def test_logprobs_go_out_one_entry_per_token():
    from services.engine.core.interfaces import TokenLogprobs

    logprobs = [TokenLogprobs(-0.5, [7, 3], [-0.5, -1.5]), TokenLogprobs(-2.0, [], [])]
    response = response_from_output(RequestOutput("r", [7, 9], None, 3, 2, 0, logprobs=logprobs), RequestClock())
    assert [(p.sampled.token_id, p.sampled.logprob) for p in response.logprobs] == [(7, -0.5), (9, -2.0)]
    assert [(t.token_id, t.logprob) for t in response.logprobs[0].top] == [(7, -0.5), (3, -1.5)]
    assert not response.logprobs[1].top
    assert not response_from_output(output(None, [7]), RequestClock()).logprobs


def test_prompt_logprobs_go_out_one_entry_per_prompt_token_the_first_empty():
    prompt = PromptLogprobs(2, [8, 9], [-1.0, -3.0], [8, 4, 5, 9], [-1.0, -2.0, -0.5, -1.5])  # tokens 1, 2 of 3
    response = response_from_output(RequestOutput("r", [7], None, 3, 1, 0, prompt_logprobs=prompt), RequestClock())
    first, *rest = response.prompt_logprobs
    assert not first.HasField("sampled") and not first.top
    assert [(p.sampled.token_id, p.sampled.logprob) for p in rest] == [(8, -1.0), (9, -3.0)]
    assert [[(t.token_id, t.logprob) for t in p.top] for p in rest] == [[(8, -1.0), (4, -2.0)], [(5, -0.5), (9, -1.5)]]
    assert not response_from_output(output(None, [7]), RequestClock()).prompt_logprobs


def test_a_batch_keeps_plain_outputs_and_errors_together_and_each_prompt_logprobs_output_apart():
    from services.common.errors import QueueFullError
    from services.engine.serving.batch_session import BatchOutputs, BatchRequest
    from services.engine.serving.convert import batch_responses

    clock = RequestClock()
    request = BatchRequest("r", clock, scope=None, record=None)
    prompt = PromptLogprobs(1, [5, 6], [-0.5, -0.25], [5, 6], [-0.5, -0.25])
    outputs = [(request, RequestOutput("a", [1], None, 3, 1, 0)),
               (request, RequestOutput("b", [2], None, 3, 1, 0, prompt_logprobs=prompt)),
               (request, RequestOutput("c", [3], None, 3, 1, 0)),
               (request, RequestOutput("d", [4], None, 3, 1, 0, prompt_logprobs=prompt))]
    messages = batch_responses(BatchOutputs(outputs, [("e", QueueFullError("full"))]))
    assert [[r.request_id for r in m.responses] for m in messages] == [["a", "c"], ["b"], ["d"]]
    assert [[e.request_id for e in m.errors] for m in messages] == [["e"], [], []]
    assert len(messages[1].responses[0].prompt_logprobs) == 3  # the first prompt token's entry is empty
    assert batch_responses(BatchOutputs([], [])) == []
    alone = batch_responses(BatchOutputs(outputs[1:2], []))
    assert [[r.request_id for r in m.responses] for m in alone] == [["b"]]

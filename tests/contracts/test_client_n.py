"""The client's n > 1 result: messages grouped by index, finished only after every completion's final one."""

import grpc
import pytest

from llmserve import LLMServeError
from llmserve._convert import ResultBuilder, build_generate_request
from llmserve.common.v1 import common_pb2
from llmserve.textgen.v1 import textgen_pb2

LENGTH, UNSET = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_UNSPECIFIED


def _message(index: int, text: str, finish=UNSET) -> textgen_pb2.GenerateResponse:
    return textgen_pb2.GenerateResponse(request_id="r", index=index, text=text, token_ids=[len(text)],
                                        finish_reason=finish)


def test_n_option_reaches_the_request():
    assert build_generate_request("hi", None, {"n": 3}).sampling.n == 3


def test_result_groups_completions_by_index_and_waits_for_all():
    builder = ResultBuilder("r", n=2)
    for message in (_message(1, "b"), _message(0, "a"), _message(1, "B", LENGTH)):
        builder.add(message)
    assert not builder.finished
    builder.add(_message(0, "A", LENGTH))
    result = builder.result()
    assert [(c.index, c.text) for c in result.completions] == [(0, "aA"), (1, "bB")]
    assert result.text == "aA" and result.to_dict()["completions"][1]["text"] == "bB"


def test_an_index_past_n_is_a_protocol_error():
    with pytest.raises(LLMServeError) as excinfo:
        ResultBuilder("r", n=2).add(_message(2, "x"))
    assert excinfo.value.code == grpc.StatusCode.INTERNAL

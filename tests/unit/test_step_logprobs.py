"""StepLogprobs: the core -> front wire form of a step's log-probabilities survives encoding, entry by entry."""

from array import array

from services.engine.core.interfaces import EngineStats, TokenLogprobs
from services.engine.serving.messages import StepLogprobs, StepOutputs, decode, encode


def test_logprobs_of_some_outputs_round_trip_by_position():
    logprobs = StepLogprobs.empty()
    logprobs.append(0, TokenLogprobs(-0.25, [4, 9, 1], [-0.25, -1.5, -3.0]))
    logprobs.append(2, TokenLogprobs(-7.5, [], []))
    message = StepOutputs(array("q", [10, 11, 12]), array("q", [4, 5, 6]), array("q", [0, 0, 0]), [],
                          EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0), 0, logprobs=logprobs)
    unpacked = decode(encode(message)).logprobs.unpack()
    assert unpacked == {0: TokenLogprobs(-0.25, [4, 9, 1], [-0.25, -1.5, -3.0]), 2: TokenLogprobs(-7.5, [], [])}


def test_a_step_without_logprobs_carries_none():
    message = StepOutputs(array("q"), array("q"), array("q"), [], EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0), 0)
    assert decode(encode(message)).logprobs is None

"""Protobuf conversions both services share (a boundary module: it sees the generated common messages)."""

import time

from google.protobuf import duration_pb2, timestamp_pb2
from llmserve.common.v1 import common_pb2


class RequestClock:
    """Wall-clock arrival plus monotonic marks for TTFT and total duration, as the measuring process sees them."""

    def __init__(self) -> None:
        self.arrival_wall = time.time()
        self.arrival = time.monotonic()
        self.first_token: float | None = None

    def mark_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def to_proto(self) -> common_pb2.RequestTiming:
        now = time.monotonic()
        timing = common_pb2.RequestTiming(
            arrival_time=timestamp_pb2.Timestamp(seconds=int(self.arrival_wall),
                                                 nanos=int((self.arrival_wall % 1) * 1e9)),
            total_duration=_duration(now - self.arrival),
        )
        if self.first_token is not None:
            timing.time_to_first_token.CopyFrom(_duration(self.first_token - self.arrival))
        return timing


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(seconds * 1e9))
    return duration


def constraint_fields(sampling: common_pb2.SamplingParams) -> dict:
    """The structured-output field set in SamplingParams' `constraint` oneof, as {name: value} ({} for none)."""
    kind = sampling.WhichOneof("constraint")
    return {} if kind is None else {kind: getattr(sampling, kind)}

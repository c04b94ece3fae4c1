"""The one error type the client raises for a failed call, with the server's structured details."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


@dataclass(slots=True, frozen=True)
class FieldViolation:
    """One bad request field (a google.rpc.BadRequest.FieldViolation), e.g. field "sampling.top_p"."""

    field: str
    description: str


class LLMServeError(Exception):
    """A call failed: the gRPC status code, its message, and the structured details the server attached.

    `field_violations` come from google.rpc.BadRequest (INVALID_ARGUMENT); `retry_delay_s` from
    google.rpc.RetryInfo (RESOURCE_EXHAUSTED).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field_violations: tuple[FieldViolation, ...] = (),
        retry_delay_s: float | None = None,
    ) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.field_violations = field_violations
        self.retry_delay_s = retry_delay_s

    @property
    def code_name(self) -> str:
        """The status code's name, e.g. "INVALID_ARGUMENT"."""
        return self.code.name

    def __str__(self) -> str:
        text = f"{self.code_name}: {self.message}" if self.message else self.code_name
        if self.field_violations:
            text += " (" + "; ".join(f"{v.field}: {v.description}" for v in self.field_violations) + ")"
        if self.retry_delay_s is not None:
            text += f" (retry after {self.retry_delay_s:g}s)"
        return text


def error_from_rpc(err: grpc.RpcError) -> LLMServeError:
    """Convert a sync or asyncio gRPC error (a grpc.Call, or an AioRpcError) into an LLMServeError."""
    code_fn = getattr(err, "code", None)
    if not callable(code_fn):
        return LLMServeError(grpc.StatusCode.UNKNOWN, str(err))
    code = code_fn() or grpc.StatusCode.UNKNOWN
    message = err.details() or ""  # type: ignore[attr-defined]
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except ValueError:
        status = None  # the details trailer disagrees with the status: keep the plain code and message
    if status is None:
        return LLMServeError(code, message)
    violations: list[FieldViolation] = []
    retry_delay_s = None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            violations += [FieldViolation(v.field, v.description) for v in bad_request.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry_info = error_details_pb2.RetryInfo()
            detail.Unpack(retry_info)
            retry_delay_s = retry_info.retry_delay.ToTimedelta().total_seconds()
    return LLMServeError(code, message, tuple(violations), retry_delay_s)

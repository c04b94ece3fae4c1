"""Typed errors raised by either service. One interceptor maps them to gRPC status codes.

Pure Python: the engine core and the tokenizer library both raise these without importing grpc.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine will never run as given. `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message

    def __reduce__(self):
        # NOTE: pickled between the engine core and its fronts; the default would call cls(str(self)).
        return self.__class__, (self.field, self.description)


class QueueFullError(EngineError):
    """The waiting queue is at its limit; the client may retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in flight: INVALID_ARGUMENT naming "request_id", as engine.proto documents."""

    def __init__(self, message: str):
        super().__init__("request_id", message)

    def __reduce__(self):
        return self.__class__, (self.description,)


class UnavailableError(EngineError):
    """A dependency (the engine service) is down or the service is draining; the client may retry."""


class UpstreamStatusError(EngineError):
    """A status the engine service returned, passed on to the client as it is (code, message, details).

    `status` is a google.rpc.Status message; this module stays free of protobuf imports.
    """

    def __init__(self, status):
        super().__init__(status.message)
        self.status = status

"""The engine's typed errors (defined in services.common.errors, shared with the tokenizer service)."""

from services.common.errors import DuplicateRequestError, EngineError, InvalidRequestError, QueueFullError

__all__ = ["DuplicateRequestError", "EngineError", "InvalidRequestError", "QueueFullError"]

"""Typed errors raised by the tokenizer service's pure parts.

InvalidRequestError (with its `field`) and UnavailableError are the shared ones from services.common.errors,
which the one gRPC interceptor maps to status codes; the tokenizer never imports the engine package.
"""

from services.common.errors import InvalidRequestError, UnavailableError

__all__ = ["InvalidRequestError", "TokenizerLoadError", "UnavailableError"]


class TokenizerLoadError(Exception):
    """The configured model path holds no tokenizer that can be loaded from local files (a startup error)."""

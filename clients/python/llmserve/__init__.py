"""llmserve's Python client: typed sync/asyncio clients, the `llmserve` CLI, and the generated gRPC code.

The generated packages (`llmserve.common.v1`, `llmserve.textgen.v1`, `llmserve.engine.v1`) mirror protos/.
The client names below load lazily, so importing a generated module does not pull in the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLMServeClient": "llmserve.client",
    "AsyncLLMServeClient": "llmserve.client",
    "GenerationStream": "llmserve.stream",
    "AsyncGenerationStream": "llmserve.stream",
    "SERVICE_NAME": "llmserve.client",
    "LLMServeError": "llmserve.errors",
    "FieldViolation": "llmserve.errors",
    "RetryPolicy": "llmserve.retry",
    "ChatMessage": "llmserve.datatypes",
    "FinishReason": "llmserve.datatypes",
    "GenerationResult": "llmserve.datatypes",
    "ModelInfo": "llmserve.datatypes",
    "ServingStatus": "llmserve.datatypes",
    "TokenizeResult": "llmserve.datatypes",
    "Usage": "llmserve.datatypes",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from llmserve.client import SERVICE_NAME, AsyncLLMServeClient, LLMServeClient
    from llmserve.datatypes import (
        ChatMessage,
        FinishReason,
        GenerationResult,
        ModelInfo,
        ServingStatus,
        TokenizeResult,
        Usage,
    )
    from llmserve.errors import FieldViolation, LLMServeError
    from llmserve.retry import RetryPolicy
    from llmserve.stream import AsyncGenerationStream, GenerationStream


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

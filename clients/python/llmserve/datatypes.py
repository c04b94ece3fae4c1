"""Plain Python records the client returns: no protobuf types leak out of the client's public API."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import IntEnum
from typing import Any


class FinishReason(IntEnum):
    """Why a generation ended; the values equal llmserve.common.v1.FinishReason's."""

    UNSPECIFIED = 0
    LENGTH = 1
    STOP = 2
    ABORTED = 3


class ServingStatus(IntEnum):
    """A grpc.health.v1 serving status; the values equal HealthCheckResponse.ServingStatus's."""

    UNKNOWN = 0
    SERVING = 1
    NOT_SERVING = 2
    SERVICE_UNKNOWN = 3


@dataclass(slots=True, frozen=True)
class ChatMessage:
    """One chat message: `role` is e.g. "system", "user" or "assistant"."""

    role: str
    content: str


@dataclass(slots=True, frozen=True)
class Usage:
    """Token counts of one request; cached_tokens were served from the prefix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True, frozen=True)
class Timing:
    """Server-side timing of one request, in seconds; None where the server did not report a value."""

    arrival_time: datetime | None = None
    queue_s: float | None = None
    time_to_first_token_s: float | None = None
    total_s: float | None = None


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """The log-probability of one token (natural log, under the model's raw distribution: before penalties,
    temperature and filters), and its text decoded alone."""

    token_id: int
    logprob: float
    text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "text": self.text, "logprob": self.logprob}


@dataclass(slots=True, frozen=True)
class PositionLogprobs:
    """Log-probabilities at one position: the sampled token (at a prompt position, the prompt token; None for the
    first prompt token, which nothing predicts) and the top alternatives."""

    sampled: TokenLogprob | None
    top: tuple[TokenLogprob, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"sampled": self.sampled.to_dict() if self.sampled is not None else None,
                "top": [entry.to_dict() for entry in self.top]}


@dataclass(slots=True)
class GenerationResult:
    """The whole outcome of one Generate call.

    `matched_stop_token_id` (EOS or a stop token id) or `matched_stop_string` says what ended the request when
    `finish_reason` is STOP; both are None otherwise.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    matched_stop_token_id: int | None = None
    matched_stop_string: str | None = None
    timing: Timing | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    index: int = 0  # which completion (sampling n) this is
    # One per prompt token when num_prompt_logprobs was set (the first's `sampled` is None); on completion 0
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    completions: list[GenerationResult] = field(default_factory=list)  # all n of them when n > 1, by index

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (finish_reason as a lower-case name, times as ISO strings and seconds; `logprobs` and
        `prompt_logprobs` only when the request asked for them)."""
        timing = None
        if self.timing is not None:
            arrival = self.timing.arrival_time
            timing = {
                "arrival_time": arrival.isoformat() if arrival is not None else None,
                "queue_s": self.timing.queue_s,
                "time_to_first_token_s": self.timing.time_to_first_token_s,
                "total_s": self.timing.total_s,
            }
        result = {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason.name.lower(),
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
                "cached_tokens": self.usage.cached_tokens,
            },
            "matched_stop_token_id": self.matched_stop_token_id,
            "matched_stop_string": self.matched_stop_string,
            "timing": timing,
        }
        if self.logprobs:
            result["logprobs"] = [position.to_dict() for position in self.logprobs]
        if self.prompt_logprobs:
            result["prompt_logprobs"] = [position.to_dict() for position in self.prompt_logprobs]
        if self.completions:
            result["completions"] = [{"index": c.index} | (c.to_dict() if c is not self else _own(result))
                                     for c in self.completions]
        return result


def _own(result: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in result.items() if key != "completions"}


@dataclass(slots=True, frozen=True)
class TokenizeResult:
    """Token ids and the tokenizer's spelling of each (e.g. "Ġthe")."""

    token_ids: list[int]
    tokens: list[str]


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """The served model; `default_sampling` holds only the sampling fields the server has defaults for."""

    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    has_chat_template: bool
    default_sampling: dict[str, Any]

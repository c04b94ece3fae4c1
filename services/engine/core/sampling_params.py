"""Per-request sampling and stopping parameters (plain data, validated at construction)."""

from dataclasses import dataclass, field

from services.engine.core.errors import InvalidRequestError


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1.0 and min_p 0.0 disable theirs.
    A `seed` makes this request's draws reproducible whatever else shares the batch.
    The engine stops on EOS (unless `ignore_eos`) or any of `stop_token_ids`, but not before
    `min_tokens` completion tokens, and always at `max_tokens`.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field out of range."""
        if not self.temperature >= 0.0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 1, or 0/-1 to disable, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1), got {self.min_p}")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.seed is not None and self.seed < 0:
            raise InvalidRequestError("seed", f"must be >= 0, got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "ids must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

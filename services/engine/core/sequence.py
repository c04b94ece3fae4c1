"""A request's state inside the engine: its tokens, KV blocks and progress."""

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from services.engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.core.interfaces import PromptLogprobs


class SequenceStatus(IntEnum):
    WAITING = 1   # new or preempted; not yet fully prefilled
    RUNNING = 2   # prompt fully computed; decodes one token per step
    FINISHED = 3


class FinishReason(IntEnum):
    """Why a sequence ended. Values match llmserve.common.v1.FinishReason."""

    LENGTH = 1    # max_tokens (or max_model_len) reached
    STOP = 2      # EOS or a stop token id
    ABORTED = 3   # cancelled by the client or rejected after admission


@dataclass(slots=True, eq=False, weakref_slot=True)
class Sequence:
    """One request as the scheduler sees it.

    NOTE: `token_ids` is prompt + generated tokens. After a preemption the whole list is
    prefilled again, so "prompt" for the scheduler means everything not yet computed.
    `num_cached_tokens` counts tokens whose KV is in the cache (prefix hits plus computed ones).
    `block_hashes` / `block_keys`: the prefix-cache hash chain of the leading full blocks of `token_ids`, as
    far as the block manager has needed it (tokens are only appended, so it never goes stale).
    NOTE: the block manager gives `block_table` a new list whenever it (de)allocates the sequence and only
    appends to it in between; the runner's persistent block tables rely on that (see runner/block_tables.py).
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop_token_id: int | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # when its prefill first began (monotonic)
    index: int = 0  # which of its request's sampling.n completions this sequence is
    prompt_logprobs: "PromptLogprobs | None" = None  # gathered over the prompt's chunks, until sent

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether this step's prompt positions need their log-probabilities: the request asked and this is its
        first completion, not yet past its prompt (a recomputation after preemption never is)."""
        return (self.sampling.num_prompt_logprobs is not None and self.index == 0
                and len(self.token_ids) == self.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold every token of this sequence."""
        return (len(self.token_ids) + block_size - 1) // block_size

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

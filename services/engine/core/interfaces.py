"""Plain data that crosses between the scheduler and the model runner, and the runner's interface.

Only ints, lists of ints and dataclasses cross here: no tensors.
"""

from dataclasses import dataclass
from typing import Protocol

from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import FinishReason, Sequence


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch: all prefill or all decode, never mixed.

    For each sequence the runner computes the KV of
    `token_ids[num_cached_tokens : num_cached_tokens + num_scheduled_tokens]` at those positions,
    writing it into the slots given by `block_table`, and samples a next token only for sequences whose
    whole token list is computed after this step (decode sequences always; prefill ones on their last chunk).
    """

    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_batched_tokens(self) -> int:
        return sum(seq.num_scheduled_tokens for seq in self.seqs)


class ModelRunner(Protocol):
    """What the engine core needs from a model runner (a fake one in unit tests)."""

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        """Run one step; return the sampled token id per sequence, None for one still mid-prefill.

        The sample index of a sequence (for per-request seeds) is `seq.num_completion_tokens`.
        Sequences must not be mutated.
        A runner that computes log-probabilities also has `take_logprobs() -> dict[int, TokenLogprobs]`: those of
        the last `execute`, keyed by seq_id, for the sequences whose sampling asked (num_logprobs set), and
        `take_prompt_logprobs() -> dict[int, PromptLogprobs]`: the prompt tokens this step's chunk predicted, for
        the sequences with `needs_prompt_logprobs`.
        """
        ...

    def compile_grammar(self, sampling: SamplingParams) -> None:
        """Compile (or find cached) the structured-output grammar of a request with `sampling.constraint` set,
        before it is queued; raise InvalidRequestError naming the field ("sampling.regex") when it is invalid.
        Called only for constrained requests, so a runner that never gets one need not implement it.
        """
        ...


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one generated position under the model's raw distribution (before penalties,
    temperature and filters): the sampled token's, and the top alternatives, most likely first."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    """Log-probabilities of consecutive prompt tokens, each given the tokens before it, under the model's raw
    distribution (as TokenLogprobs). Entry j is about prompt token `token_ids[j]`; its `num_top` alternatives,
    most likely first, are `top_token_ids[j * num_top : (j + 1) * num_top]` (flat, so chunks concatenate).

    A whole prompt's has one entry per prompt token but the first (nothing predicts it).
    """

    num_top: int
    token_ids: list[int]  # [M]
    logprobs: list[float]  # [M]
    top_token_ids: list[int]  # [M * num_top]
    top_logprobs: list[float]  # [M * num_top]

    def extend(self, chunk: "PromptLogprobs") -> None:
        """Append the entries of the chunk that follows these in the prompt."""
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.top_token_ids += chunk.top_token_ids
        self.top_logprobs += chunk.top_logprobs

    def positions(self) -> list[TokenLogprobs]:
        """One TokenLogprobs per entry (the prompt token's logprob and its alternatives)."""
        k = self.num_top
        return [TokenLogprobs(logprob, self.top_token_ids[j * k:(j + 1) * k], self.top_logprobs[j * k:(j + 1) * k])
                for j, logprob in enumerate(self.logprobs)]


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: its new token ids, and the finish reason on the last.

    `logprobs` has one entry per new token id when the request asked for them, else None. `prompt_logprobs` is
    set on completion 0's output with its first token, when the request asked (sampling.num_prompt_logprobs).
    `index`: which of the request's sampling.n completions this is. `finish_reason` ends that completion;
    `request_finished` is set on the last output of the whole request (after every completion's final one).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    matched_stop_token_id: int | None = None
    queue_time_s: float | None = None  # on the last output: arrival to first scheduled
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0
    request_finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    """Live figures of the engine (also the GetLoad report)."""

    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_cached_prompt_tokens: int
    num_computed_prompt_tokens: int
    num_generated_tokens: int

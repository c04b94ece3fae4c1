"""best_of > n: hold a request's completions back until every one has finished, then release the n best.

"Best" is the highest cumulative log-probability of the sampled tokens under the model's raw distribution (the
sampled token's TokenLogprobs.logprob, which the runner computes for these requests: see
engine._completion_params). The choice needs every completion finished, so nothing of such a request is
reported before then; each chosen completion then comes as one output holding all its tokens, renumbered
0..n-1 in rank order (ties: the lower generated index first).

EngineCore.step() passes its outputs through here, so the offline LLM and the engine service both get the same
rule from this one place.
"""

from dataclasses import dataclass, field

from services.engine.core.interfaces import PromptLogprobs, RequestOutput, TokenLogprobs
from services.engine.core.sequence import FinishReason


@dataclass(slots=True)
class _Held:
    """One best_of request's completions so far, by generated index."""

    n: int
    keep_logprobs: bool  # the request asked for logprobs itself (else they were computed only to rank)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    finals: dict[int, RequestOutput] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # sent once, on generated completion 0's first output

    def add(self, output: RequestOutput) -> None:
        self.token_ids.setdefault(output.index, []).extend(output.new_token_ids)
        self.logprobs.setdefault(output.index, []).extend(output.logprobs or ())
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finish_reason is not None:
            self.finals[output.index] = output

    def release(self) -> list[RequestOutput]:
        """The request's outputs once its last completion finished: the n best, or n ABORTED if it was aborted."""
        if any(final.finish_reason == FinishReason.ABORTED for final in self.finals.values()):
            last = next(iter(self.finals.values()))
            return [RequestOutput(last.request_id, [], FinishReason.ABORTED, last.num_prompt_tokens, 0,
                                  last.num_cached_tokens, queue_time_s=last.queue_time_s, index=rank,
                                  request_finished=rank == self.n - 1) for rank in range(self.n)]
        ranked = sorted(self.finals, key=lambda index: (-self.cumulative_logprob(index), index))[:self.n]
        outputs = [self._ranked_output(index, rank) for rank, index in enumerate(ranked)]
        outputs[0].prompt_logprobs = self.prompt_logprobs  # the prompt's entries go with rank 0, as with index 0
        return outputs

    def cumulative_logprob(self, index: int) -> float:
        return sum(position.logprob for position in self.logprobs[index])

    def _ranked_output(self, index: int, rank: int) -> RequestOutput:
        final = self.finals[index]
        return RequestOutput(
            final.request_id, self.token_ids[index], final.finish_reason, final.num_prompt_tokens,
            final.num_completion_tokens, final.num_cached_tokens, final.matched_stop_token_id, final.queue_time_s,
            logprobs=self.logprobs[index] if self.keep_logprobs else None, index=rank,
            request_finished=rank == self.n - 1)


class BestOfSelector:
    """The best_of > n requests in flight; `select` turns a step's outputs into what callers may see."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, request_id: str, n: int, keep_logprobs: bool) -> None:
        """Hold back this request's outputs from now on (call when it is added)."""
        self._held[request_id] = _Held(n, keep_logprobs)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def select(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` without those of held requests, plus the ranked outputs of held requests that just ended."""
        selected = []
        for output in outputs:
            held = self._held.get(output.request_id)
            if held is None:
                selected.append(output)
                continue
            held.add(output)
            if output.request_finished:
                del self._held[output.request_id]
                selected.extend(held.release())
        return selected

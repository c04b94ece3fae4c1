"""TextStream: one request's generated ids -> incremental detokenizer -> stop strings -> client text deltas."""

from collections.abc import Iterable, Sequence

from services.tokenizer.detokenizer import Decoder, IncrementalDetokenizer
from services.tokenizer.stop import StopStringMatcher


class TextStream:
    """One request's output: generated ids → incremental detokenizer → stop strings → client deltas."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        stops: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self._matcher = StopStringMatcher(stops, include_stop_str_in_output)
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._parts: list[str] = []

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output; the caller then aborts the engine request."""
        return self._matcher.matched_stop

    @property
    def text(self) -> str:
        """All text handed out so far."""
        return "".join(self._parts)

    def push(self, new_ids: Iterable[int]) -> tuple[str, str | None]:
        """Add generated ids; return (delta for the client, matched stop string or None)."""
        if self._matcher.matched_stop is not None:
            return "", self._matcher.matched_stop
        delta, matched = self._matcher.push(self._detokenizer.step(new_ids))
        return self._record(delta), matched

    def finish(self) -> str:
        """The engine finished: return the last delta (held-back text), unless a stop string ended it."""
        if self._matcher.matched_stop is not None:
            return ""
        delta, matched = self._matcher.push(self._detokenizer.flush())
        if matched is None:
            delta += self._matcher.finish()
        return self._record(delta)

    def _record(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta

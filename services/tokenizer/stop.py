"""Stop strings over a stream of text deltas (services.tokenizer.text_stream puts them behind the detokenizer).

A stop string may span deltas (tokens) or end inside one. The matcher holds back the shortest tail
that could still grow into a stop string (the longest suffix that is a proper prefix of one), so no
delta ever shows text that a later match cuts off. When several stop strings occur, the one that
completes first wins (ties: the one that starts first); that choice does not depend on how the text
was split into deltas.
"""

from collections.abc import Sequence

from services.tokenizer.errors import InvalidRequestError


def validate_stop_strings(stops: Sequence[str]) -> list[str]:
    """Raise InvalidRequestError("stop[i]") for a non-string or empty entry; return the distinct stops."""
    if isinstance(stops, str):
        raise InvalidRequestError("stop", "must be a list of strings")
    for i, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise InvalidRequestError(f"stop[{i}]", f"must be a string, got {type(stop).__name__}")
        if not stop:
            raise InvalidRequestError(f"stop[{i}]", "must not be empty")
    return list(dict.fromkeys(stops))


class StopStringMatcher:
    """Feeds on text deltas; emits what is safe to show and reports the stop string that ended the text."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False):
        self._stops = validate_stop_strings(stops)
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._matched: str | None = None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._matched

    def push(self, delta: str) -> tuple[str, str | None]:
        """Return (text that may be shown now, the matched stop string or None).

        After a match the text ends before the stop string (or after it when it is included), and
        every later call returns ("", the same stop string).
        """
        if self._matched is not None:
            return "", self._matched
        if not self._stops:
            return delta, None
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self._matched, self._held = stop, ""
            return text[: start + len(stop) if self._include else start], stop
        num_held = self._num_to_hold(text)
        self._held = text[len(text) - num_held :]
        return text[: len(text) - num_held], None

    def finish(self) -> str:
        """End of the stream: release the held-back text (nothing after a match)."""
        held, self._held = self._held, ""
        return "" if self._matched is not None else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_to_hold(self, text: str) -> int:
        for n in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[len(text) - n :]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0

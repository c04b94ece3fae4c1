"""Incremental detokenization: token ids in, append-only text deltas out, never a broken character.

The method keeps a short window of ids. `_read` splits it: the ids before it are already text
(`_prefix_text`), the ids after it are pending. Each new id is decoded together with the window, and
the text past `_prefix_text` is emitted unless it ends in U+FFFD, which is what a decoder produces for
a multi-byte character that is not complete yet; then the window slides so that it starts where the
previous emission started. Each step decodes a handful of ids, so the cost per token does not grow
with the output.

The first window holds the prompt's last few ids, so the first generated token is decoded in context
(a leading space survives, a character the prompt left incomplete is completed). When the prompt ends
mid-character, that character is emitted as part of the output once the output completes it: the
prompt's complete text followed by the deltas is the decode of prompt + output.

For byte-level BPE tokenizers (the default model) the concatenated deltas equal the full decode of the
output ids, invalid byte sequences included (unless the prompt ends mid-character, as above). NOTE: a
genuine U+FFFD at the end of a token's text is held until the next token or flush. Decoders that
replace whole runs of byte-fallback tokens (SentencePiece `<0x..>`) agree on valid text; on invalid
byte runs they may differ in the number of U+FFFD characters.

With a `tokenizers` backend (a TextTokenizer, a transformers fast tokenizer or a `tokenizers.Tokenizer`), the
same method runs inside that library: `tokenizers.decoders.DecodeStream` keeps the window in Rust, one call
per token instead of two decodes of Python lists (bench/detokenize.py measures both). The deltas are the same
(tests/tokenizer/test_detokenizer.py runs every case both ways). Any other Decoder gets the window method.
"""

from collections.abc import Iterable, Sequence
from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
INITIAL_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer: TextTokenizer, a `tokenizers.Tokenizer`, or a
    transformers tokenizer (whose Rust backend is then used, so no tokenization-space clean-up applies)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas (see the module docstring). flush() ends the stream."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 use_decode_stream: bool = True):
        backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer: Decoder = backend if isinstance(backend, Tokenizer) else tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = list(prompt_ids[max(0, len(prompt_ids) - INITIAL_CONTEXT_TOKENS) :])
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        while self._read > 0 and self._prefix_text.endswith(REPLACEMENT_CHAR):
            self._read -= 1
            self._prefix_text = self._decode(self._window[: self._read])
        self._num_pending = 0
        self._parts: list[str] = []
        self._text_cache: str | None = ""
        self._stream: DecodeStream | None = None
        if use_decode_stream and isinstance(backend, Tokenizer):
            self._start_stream()

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
        return self._text_cache

    @property
    def num_pending_ids(self) -> int:
        """Generated ids received but not yet turned into text (an incomplete character)."""
        return self._num_pending

    def step(self, new_ids: Iterable[int]) -> str:
        """Add generated ids; return the text they complete (possibly empty), never a partial character."""
        step_one = self._step_stream if self._stream is not None else self._step_window
        return self._emit("".join([step_one(token_id) for token_id in new_ids]))

    def flush(self) -> str:
        """End of the stream: return whatever is still held, invalid bytes shown as U+FFFD."""
        if self._num_pending == 0:
            return ""
        if self._stream is not None:  # the window method's state, from the stream's: then flush as it does
            self._stream = None
            self._window, self._read = self._context + self._pending, len(self._context)
            self._prefix_text = self._decode(self._context)
        text = self._decode(self._window)
        delta = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._advance(len(self._window), "")
        return self._emit(delta)

    def _start_stream(self) -> None:
        """The window so far as a DecodeStream: the settled context is its prefix; the ids after it (a prompt
        that ends mid-character) are stepped in and stay pending, as in the window method."""
        self._context: list[int] = self._window[: self._read]  # the ids of the stream's prefix
        self._pending: list[int] = self._window[self._read :]  # ids stepped in since that prefix
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=self._skip_special_tokens)
        for token_id in self._pending:
            self._stream.step(self._tokenizer, token_id)

    def _step_stream(self, token_id: int) -> str:
        try:
            delta = self._stream.step(self._tokenizer, token_id)
        except Exception:  # noqa: BLE001 (the new text does not extend the prefix: let the window method judge)
            self._stream = None
            self._window, self._read = self._context + self._pending, len(self._context)
            self._prefix_text = self._decode(self._context)
            return self._step_window(token_id)
        if delta is None:
            self._pending.append(token_id)
            if self._num_pending or self._decode([token_id]):  # else a token without text (a skipped special)
                self._num_pending += 1
            return ""
        self._pending.append(token_id)
        self._context, self._pending = self._pending, []
        self._num_pending = 0
        return delta

    def _step_window(self, token_id: int) -> str:
        self._window.append(token_id)
        self._num_pending += 1
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        if text == self._prefix_text:
            self._read = len(self._window)
            self._num_pending = 0
            return ""
        if len(text) < len(self._prefix_text):
            return ""
        delta = text[len(self._prefix_text) :]
        self._advance(self._read, self._decode(self._window[self._read :]))
        return delta

    def _advance(self, new_start: int, new_prefix_text: str) -> None:
        """Drop the ids before `new_start`; everything left in the window is now decoded context."""
        del self._window[:new_start]
        self._read = len(self._window)
        self._prefix_text = new_prefix_text
        self._num_pending = 0

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
            self._text_cache = None
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

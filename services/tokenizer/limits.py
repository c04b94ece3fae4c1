"""Size limits the tokenizer service applies before tokenizing, so an oversized request costs almost nothing.

The rule never rejects a prompt that fits: every input character is covered by some token, and no token
covers more than `max_chars_per_token` characters (the longest vocabulary entry's text, special tokens
included, plus one for a character split at a token's edge). So a text longer than
max_chars_per_token * max_model_len characters is more than max_model_len tokens, whatever the tokenizer
makes of it. NOTE: this assumes a tokenizer that drops no input (byte-level BPE, SentencePiece: the
models we serve); a word-level tokenizer that discards whitespace could fit longer texts.
A chat template writes at least one token per message (its role header) and copies each content
verbatim, so a conversation with more than max_model_len messages, or more content characters than the
text limit, cannot fit either.

The receive limit (the largest request message the server accepts) follows from the same bound with the
model's context length (which caps max_model_len) and UTF-8's 4 bytes per character at most.
"""

from dataclasses import dataclass
from typing import Any

from services.tokenizer.errors import InvalidRequestError

CHAT_FRAMING_BYTES = 64  # per chat message: its protobuf framing and role
OTHER_FIELDS_BYTES = 1 << 20  # sampling, stop strings, request id
DEFAULT_CONTEXT_LENGTH = 32_768  # when the model's own is unknown (a tokenizer-only directory)
MAX_UTF8_BYTES_PER_CHAR = 4
# Inputs up to this many characters (or ids) are tokenized on the event loop: ~1 ms of work, less than a thread
# hop costs the other streams. Larger ones go to a thread (tokenizers releases the GIL while it works).
INLINE_MAX_CHARS = 4096


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Per-tokenizer bounds; see the module docstring."""

    max_chars_per_token: int

    @classmethod
    def of(cls, tokenizer: Any) -> "InputLimits":
        """From a TextTokenizer: the longest text one token stands for, plus one (~0.2 s for 50k ids)."""
        decode = tokenizer.decode
        longest = max(len(decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size))
        return cls(longest + 1)

    def receive_bytes(self, context_length: int | None) -> int:
        """The largest GenerateRequest any max_model_len <= context_length can need."""
        context_length = context_length or DEFAULT_CONTEXT_LENGTH
        text_bytes = MAX_UTF8_BYTES_PER_CHAR * self.max_chars_per_token * context_length
        return text_bytes + CHAT_FRAMING_BYTES * context_length + OTHER_FIELDS_BYTES

    def check_prompt(self, request: Any, max_model_len: int) -> int:
        """Reject a prompt that cannot fit in max_model_len tokens (INVALID_ARGUMENT naming the field).

        `request` is a GenerateRequest or TokenizeRequest. Returns the prompt's size in characters (ids for a
        token-id prompt), for choosing between tokenizing inline and in a thread.
        """
        which = request.WhichOneof("prompt" if hasattr(request, "token_ids") else "input")
        max_chars = self.max_chars_per_token * max_model_len
        if which == "text":
            if len(request.text) > max_chars:
                raise InvalidRequestError("text", f"{len(request.text)} characters cannot fit in max_model_len "
                                          f"{max_model_len} tokens (at most {max_chars} characters)")
            return len(request.text)
        if which == "chat":
            messages = request.chat.messages
            if len(messages) > max_model_len:
                raise InvalidRequestError("chat.messages", f"{len(messages)} messages cannot fit in max_model_len "
                                          f"{max_model_len} tokens (each takes at least one)")
            num_chars = sum(len(message.content) for message in messages)
            if num_chars > max_chars:
                raise InvalidRequestError("chat.messages", f"{num_chars} characters of content cannot fit in "
                                          f"max_model_len {max_model_len} tokens (at most {max_chars})")
            return num_chars + len(messages)
        if which == "token_ids":
            if len(request.token_ids.ids) > max_model_len:
                raise InvalidRequestError("token_ids", f"the prompt has {len(request.token_ids.ids)} tokens; "
                                          f"max_model_len is {max_model_len}")
            return len(request.token_ids.ids)
        return 0

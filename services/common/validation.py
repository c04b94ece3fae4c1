"""The one validator of request values, shared by every entry point (tokenizer service, engine service, offline LLM).

Pure Python: no protobuf, no torch. Each check raises InvalidRequestError whose `field` is the contract's name
(protos/llmserve/common/v1/common.proto, engine/v1/engine.proto): "sampling.temperature", "prompt_token_ids", ...
A caller whose prompt field has another name on its own contract (the public API's "text", "chat",
"token_ids.ids") passes that name in.
"""

import json
import math
from collections.abc import Sequence

from services.common.errors import InvalidRequestError

PROMPT_TOKEN_IDS = "prompt_token_ids"
MAX_TOKENS = "sampling.max_tokens"
STOP_TOKEN_IDS = "sampling.stop_token_ids"
REQUEST_ID = "request_id"
MAX_REQUEST_ID_LEN = 256  # characters, each one byte: printable ASCII only
_PRINTABLE_ASCII = frozenset(range(0x20, 0x7F))


def check_request_id(request_id: str) -> None:
    """The one rule for request ids, at both services: 1 to MAX_REQUEST_ID_LEN printable ASCII characters.

    Ids are echoed in every response message and written into log lines, so an unbounded id multiplies
    the response size and a newline or control character could forge a log line. An empty id is the
    caller's business (the tokenizer service makes one up; the engine service requires one).
    """
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequestError(REQUEST_ID, f"must be at most {MAX_REQUEST_ID_LEN} characters, "
                                              f"got {len(request_id)}")
    if request_id.isascii() and request_id.isprintable():  # exactly 0x20-0x7e: the rule, 10x cheaper than the scan
        return
    bad = next((char for char in request_id if ord(char) not in _PRINTABLE_ASCII), None)
    if bad is not None:
        raise InvalidRequestError(REQUEST_ID, f"must be printable ASCII (0x20-0x7e), got {bad!r} "
                                              f"at index {request_id.index(bad)}")


def loggable_request_id(request_id: str) -> str:
    """A request id as logs and metrics may carry it before check_request_id passed: at most
    MAX_REQUEST_ID_LEN characters (the logger escapes the rest), so a refused 8 MB id costs one short line."""
    if len(request_id) <= MAX_REQUEST_ID_LEN:
        return request_id
    return f"{request_id[:MAX_REQUEST_ID_LEN]}...({len(request_id)} characters)"


def escape_for_log(text: str) -> str:
    """`text` with every character outside printable ASCII escaped (a newline becomes the two characters \\n),
    so a client's string can never start a log line of its own."""
    if all(ord(char) in _PRINTABLE_ASCII for char in text):
        return text
    return "".join(char if ord(char) in _PRINTABLE_ASCII else char.encode("unicode_escape").decode("ascii")
                   for char in text)
MAX_N = 16  # the most completions one request may ask for (sampling.n)
MAX_LOGPROBS = 20  # the most alternatives per position a request may ask for (OpenAI's top_logprobs limit)


def check_sampling(*, temperature: float, top_k: int, top_p: float, min_p: float, max_tokens: int,
                   min_tokens: int, seed: int | None, n: int = 1, best_of: int | None = None) -> None:
    """Raise InvalidRequestError("sampling.<name>") for the first value out of its documented range.

    temperature: finite, >= 0 (0 = greedy). top_k: >= 1, or 0 / -1 to disable it. top_p: (0, 1].
    min_p: [0, 1). max_tokens >= 1. min_tokens: [0, max_tokens]. seed: None or >= 0. n: [1, MAX_N].
    best_of: None or [n, MAX_N]. NaN fails every range.
    """
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise InvalidRequestError("sampling.temperature", f"must be a finite number >= 0, got {temperature}")
    if top_k < -1:
        raise InvalidRequestError("sampling.top_k", f"must be >= 1, or 0 / -1 to disable top-k, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p < 1.0:
        raise InvalidRequestError("sampling.min_p", f"must be in [0, 1), got {min_p}")
    if max_tokens < 1:
        raise InvalidRequestError(MAX_TOKENS, f"must be >= 1, got {max_tokens}")
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequestError("sampling.min_tokens", f"must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    if seed is not None and seed < 0:
        raise InvalidRequestError("sampling.seed", f"must be >= 0, got {seed}")
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError("sampling.n", f"must be in [1, {MAX_N}], got {n}")
    if best_of is not None and not n <= best_of <= MAX_N:
        raise InvalidRequestError("sampling.best_of", f"must be in [n={n}, {MAX_N}], got {best_of}")


def check_wire_sampling(*, top_k: int | None) -> None:
    """The checks only the gRPC contracts have (None = the field is unset).

    An explicit top_k of 0 is rejected there (unset disables top-k).
    """
    if top_k == 0:
        raise InvalidRequestError("sampling.top_k", "must be >= 1 (leave it unset to disable top-k)")


def check_extras(*, num_logprobs: int | None, repetition_penalty: float, presence_penalty: float,
                 frequency_penalty: float, num_prompt_logprobs: int | None = None) -> None:
    """Log-probabilities and penalties. num_logprobs and num_prompt_logprobs: None or [0, MAX_LOGPROBS].
    repetition_penalty: finite, > 0 (1 disables it). presence_penalty and frequency_penalty: [-2, 2] (0 disables
    them). NaN fails every range."""
    for name, value in (("num_logprobs", num_logprobs), ("num_prompt_logprobs", num_prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise InvalidRequestError(f"sampling.{name}", f"must be in [0, {MAX_LOGPROBS}], got {value}")
    if not (math.isfinite(repetition_penalty) and repetition_penalty > 0.0):
        raise InvalidRequestError("sampling.repetition_penalty",
                                  f"must be a finite number > 0, got {repetition_penalty}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -2.0 <= value <= 2.0:
            raise InvalidRequestError(f"sampling.{name}", f"must be in [-2, 2], got {value}")


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise InvalidRequestError(field) unless every id is in [0, vocab_size)."""
    bad = next((token_id for token_id in token_ids if not 0 <= token_id < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(field, f"token id {bad} is not in [0, vocab_size={vocab_size})")


def check_prompt(field: str, prompt_token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt must be non-empty, in the vocabulary and no longer than max_model_len."""
    if not prompt_token_ids:
        raise InvalidRequestError(field, "must not be empty")
    check_token_ids(field, prompt_token_ids, vocab_size)
    if len(prompt_token_ids) > max_model_len:
        raise InvalidRequestError(field, f"the prompt has {len(prompt_token_ids)} tokens; "
                                         f"max_model_len is {max_model_len}")


def check_room_for_completion(prompt_field: str, num_prompt_tokens: int, max_model_len: int) -> None:
    """With max_tokens unset (it fills the context), the prompt must leave room for one token: blame the prompt.

    The caller never set max_tokens, so an error naming it would point at nothing they can change.
    """
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(prompt_field, f"the prompt has {num_prompt_tokens} tokens, leaving no room for a "
                                                f"completion in max_model_len {max_model_len}")


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """prompt + max_tokens must fit in max_model_len (blamed on max_tokens: the prompt alone fits)."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(MAX_TOKENS, f"prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) "
                                              f"exceeds max_model_len {max_model_len}")


# Structured-output constraints: the kind of each (also the contract's field name after "sampling.").
CONSTRAINT_KINDS = ("json_schema", "regex", "grammar", "json_object")


def check_constraint(*, json_schema: str | None = None, regex: str | None = None, grammar: str | None = None,
                     json_object: bool = False, ignore_eos: bool = False, min_tokens: int = 0) -> tuple[str, str] | None:
    """The request's structured-output constraint as (kind, text), or None when unconstrained.

    At most one kind may be set; a set text must be non-empty and a JSON schema must be a JSON object (or
    boolean). Whether a schema, regex or grammar compiles is the engine's to say (it compiles them); this
    is the cheap, pure-Python part every entry point shares. A constraint ends on EOS, so it cannot be
    combined with ignore_eos, nor with min_tokens (which would ban EOS where the grammar needs it).
    """
    given = {"json_schema": json_schema, "regex": regex, "grammar": grammar, "json_object": json_object or None}
    kinds = [kind for kind in CONSTRAINT_KINDS if given[kind] is not None]
    if not kinds:
        return None
    if len(kinds) > 1:
        raise InvalidRequestError(f"sampling.{kinds[1]}", f"only one of {', '.join(CONSTRAINT_KINDS)} may be set; "
                                                          f"got {' and '.join(kinds)}")
    kind = kinds[0]
    text = "" if kind == "json_object" else given[kind]
    if kind != "json_object" and (not isinstance(text, str) or not text.strip()):
        raise InvalidRequestError(f"sampling.{kind}", "must be a non-empty string")
    if kind == "json_schema":
        _check_json_schema_text(text)
    if ignore_eos:
        raise InvalidRequestError("sampling.ignore_eos", f"cannot be combined with sampling.{kind}: "
                                                         "a constrained completion ends on EOS")
    if min_tokens > 0:
        raise InvalidRequestError("sampling.min_tokens", f"cannot be combined with sampling.{kind}: "
                                                         "the grammar decides where the completion ends")
    return kind, text


def _check_json_schema_text(text: str) -> None:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError("sampling.json_schema", f"is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("sampling.json_schema", f"must be a JSON object, got {type(schema).__name__}")

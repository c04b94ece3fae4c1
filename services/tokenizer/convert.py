"""Public request -> resolved engine request: prompt to ids, sampling defaults, validation with field names."""

import math
import uuid
from dataclasses import dataclass

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2
from llmserve.textgen.v1 import textgen_pb2

from services.common.errors import InvalidRequestError
from services.tokenizer.stop import validate_stop_strings
from services.tokenizer.tokenizer import TextTokenizer


@dataclass(slots=True)
class ResolvedRequest:
    """A public Generate request made concrete: prompt ids, every sampling value, stop strings."""

    request_id: str
    prompt_field: str
    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams
    stops: list[str]
    skip_special_tokens: bool
    include_stop_str_in_output: bool

    def engine_request(self) -> engine_pb2.GenerateRequest:
        """The engine call. Its id is the caller's plus a fresh suffix: callers' ids need not be unique, and an
        engine id must be (a retry right after a cancel would otherwise collide with the aborted request)."""
        return engine_pb2.GenerateRequest(request_id=f"{self.request_id}-{uuid.uuid4().hex[:12]}",
                                          prompt_token_ids=self.prompt_ids, sampling=self.sampling)


def prompt_ids(request, tokenizer: TextTokenizer, add_special_tokens: bool = True) -> tuple[str, list[int]]:
    """(field name, token ids) of a GenerateRequest's or TokenizeRequest's prompt oneof."""
    which = request.WhichOneof("prompt" if hasattr(request, "token_ids") else "input")
    if which == "text":
        if not request.text:
            raise InvalidRequestError("text", "must not be empty")
        return "text", tokenizer.encode(request.text, add_special_tokens=add_special_tokens)
    if which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        return "chat", tokenizer.apply_chat_template(messages)
    if which == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequestError("token_ids.ids", "must not be empty")
        check_ids("token_ids.ids", ids, tokenizer.vocab_size)
        return "token_ids", ids
    raise InvalidRequestError("prompt", "set one of text, chat or token_ids")


def check_ids(field: str, ids: list[int], vocab_size: int) -> None:
    bad = next((token_id for token_id in ids if token_id >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(field, f"token id {bad} is not below the vocabulary size {vocab_size}")


def resolve_sampling(proto: common_pb2.SamplingParams, defaults: dict, num_prompt_tokens: int,
                     max_model_len: int, default_max_tokens: int, vocab_size: int) -> common_pb2.SamplingParams:
    """Every field set: the request's value, else the model's generation default; ranges checked."""
    resolved = common_pb2.SamplingParams()
    resolved.CopyFrom(proto)
    for name in ("temperature", "top_p", "min_p"):
        if not proto.HasField(name):
            setattr(resolved, name, float(defaults.get(name, 1.0 if name != "min_p" else 0.0)))
    if not proto.HasField("top_k") and defaults.get("top_k", 0):
        resolved.top_k = int(defaults["top_k"])
    room = max_model_len - num_prompt_tokens
    if not proto.HasField("max_tokens"):
        resolved.max_tokens = max(1, min(default_max_tokens, room))
    _check_ranges(resolved, proto)
    if num_prompt_tokens + resolved.max_tokens > max_model_len:
        raise InvalidRequestError("sampling.max_tokens", f"prompt ({num_prompt_tokens}) + max_tokens "
                                  f"({resolved.max_tokens}) exceeds max_model_len {max_model_len}")
    check_ids("sampling.stop_token_ids", list(resolved.stop_token_ids), vocab_size)
    return resolved


def _check_ranges(sampling: common_pb2.SamplingParams, proto: common_pb2.SamplingParams) -> None:
    if not (sampling.temperature >= 0 and math.isfinite(sampling.temperature)):
        raise InvalidRequestError("sampling.temperature", f"must be >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {sampling.top_p}")
    if proto.HasField("top_k") and proto.top_k == 0:
        raise InvalidRequestError("sampling.top_k", "must be >= 1 (leave it unset to disable top-k)")
    if not 0 <= sampling.min_p < 1:
        raise InvalidRequestError("sampling.min_p", f"must be in [0, 1), got {sampling.min_p}")
    if sampling.max_tokens == 0:
        raise InvalidRequestError("sampling.max_tokens", "must be >= 1")
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequestError("sampling.min_tokens", "must not exceed max_tokens")
    if sampling.HasField("num_logprobs"):
        raise InvalidRequestError("sampling.num_logprobs", "log-probabilities are not supported yet")


def resolve_generate(request: textgen_pb2.GenerateRequest, request_id: str, tokenizer: TextTokenizer,
                     max_model_len: int, default_max_tokens: int) -> ResolvedRequest:
    field, ids = prompt_ids(request, tokenizer)
    if len(ids) > max_model_len:
        raise InvalidRequestError(field, f"the prompt has {len(ids)} tokens; max_model_len is {max_model_len}")
    sampling = resolve_sampling(request.sampling, tokenizer.generation_defaults(), len(ids), max_model_len,
                                default_max_tokens, tokenizer.vocab_size)
    return ResolvedRequest(
        request_id=request_id,
        prompt_field=field,
        prompt_ids=ids,
        sampling=sampling,
        stops=validate_stop_strings(list(request.stop)),
        skip_special_tokens=request.skip_special_tokens if request.HasField("skip_special_tokens") else True,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )

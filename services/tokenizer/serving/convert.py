"""Public request -> resolved engine request: prompt to ids, sampling defaults, validation with field names."""

import uuid
from dataclasses import dataclass

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2
from llmserve.textgen.v1 import textgen_pb2

from services.common.convert import constraint_fields
from services.common.errors import InvalidRequestError
from services.common.validation import (
    MAX_REQUEST_ID_LEN, STOP_TOKEN_IDS, check_constraint, check_extras, check_fits, check_prompt,
    check_room_for_completion, check_sampling, check_token_ids, check_wire_sampling)
from services.tokenizer.stop import validate_stop_strings
from services.tokenizer.tokenizer import TextTokenizer


ENGINE_ID_SUFFIX_LEN = 13  # "-" and 12 hex digits


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
        engine id must be (a retry right after a cancel would otherwise collide with the aborted request). The
        caller's part is cut so that the whole id stays within the one request-id rule (check_request_id)."""
        prefix = self.request_id[:MAX_REQUEST_ID_LEN - ENGINE_ID_SUFFIX_LEN]
        return engine_pb2.GenerateRequest(request_id=f"{prefix}-{uuid.uuid4().hex[:ENGINE_ID_SUFFIX_LEN - 1]}",
                                          prompt_token_ids=self.prompt_ids, sampling=self.sampling)


def prompt_ids(request, tokenizer: TextTokenizer, add_special_tokens: bool = True) -> tuple[str, list[int]]:
    """(contract field name, token ids) of a GenerateRequest's or TokenizeRequest's prompt oneof."""
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
        check_token_ids("token_ids.ids", ids, tokenizer.vocab_size)
        return "token_ids.ids", ids
    raise InvalidRequestError("prompt", "set one of text, chat or token_ids")


# The tokenizer server's Detokenize checks its ids with the same function.
check_ids = check_token_ids


def resolve_sampling(proto: common_pb2.SamplingParams, defaults: dict, num_prompt_tokens: int,
                     max_model_len: int, default_max_tokens: int, vocab_size: int) -> common_pb2.SamplingParams:
    """Every field set: the request's value, else the model's generation default; ranges checked.

    A repetition_penalty default is sent only when it is not neutral (1); presence and frequency penalties have
    no model default.
    """
    check_wire_sampling(top_k=proto.top_k if proto.HasField("top_k") else None)
    resolved = common_pb2.SamplingParams()
    resolved.CopyFrom(proto)
    for name in ("temperature", "top_p", "min_p"):
        if not proto.HasField(name):
            setattr(resolved, name, float(defaults.get(name, 1.0 if name != "min_p" else 0.0)))
    if not proto.HasField("repetition_penalty") and defaults.get("repetition_penalty", 1.0) != 1.0:
        resolved.repetition_penalty = float(defaults["repetition_penalty"])
    if not proto.HasField("top_k") and defaults.get("top_k", 0):
        resolved.top_k = int(defaults["top_k"])
    if not proto.HasField("max_tokens"):
        resolved.max_tokens = max(1, min(default_max_tokens, max_model_len - num_prompt_tokens))
    check_sampling(temperature=resolved.temperature, top_k=resolved.top_k, top_p=resolved.top_p,
                   min_p=resolved.min_p, max_tokens=resolved.max_tokens, min_tokens=resolved.min_tokens,
                   seed=resolved.seed if resolved.HasField("seed") else None,
                   n=resolved.n if resolved.HasField("n") else 1,
                   best_of=resolved.best_of if resolved.HasField("best_of") else None)
    check_extras(num_logprobs=resolved.num_logprobs if resolved.HasField("num_logprobs") else None,
                 repetition_penalty=resolved.repetition_penalty if resolved.HasField("repetition_penalty") else 1.0,
                 presence_penalty=resolved.presence_penalty, frequency_penalty=resolved.frequency_penalty,
                 num_prompt_logprobs=(resolved.num_prompt_logprobs if resolved.HasField("num_prompt_logprobs")
                                      else None))
    check_fits(num_prompt_tokens, resolved.max_tokens, max_model_len)
    check_token_ids(STOP_TOKEN_IDS, list(resolved.stop_token_ids), vocab_size)
    # The constraint passes through as it is; the engine compiles it (and rejects what does not compile).
    check_constraint(**constraint_fields(resolved), ignore_eos=resolved.ignore_eos, min_tokens=resolved.min_tokens)
    return resolved


def resolve_generate(request: textgen_pb2.GenerateRequest, request_id: str, tokenizer: TextTokenizer,
                     max_model_len: int, default_max_tokens: int) -> ResolvedRequest:
    field, ids = prompt_ids(request, tokenizer)
    check_prompt(field, ids, tokenizer.vocab_size, max_model_len)
    if not request.sampling.HasField("max_tokens"):
        check_room_for_completion(field, len(ids), max_model_len)
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

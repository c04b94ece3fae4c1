"""Offline API: `LLM(...).generate(prompts, sampling_params)` over the engine core, in one process."""

import dataclasses
import itertools
import os
from collections.abc import Sequence as SequenceABC
from numbers import Integral

from tqdm.auto import tqdm

from services.common.default_model import model_display_name
from services.common.generation_defaults import read_generation_config, sampling_defaults
from services.engine.config import EngineArgs
from services.engine.core.engine import EngineCore
from services.engine.core.errors import InvalidRequestError
from services.engine.core.sampling_params import SamplingParams
from services.engine.loader import gguf_file_of
from services.engine.runner.model_runner import ModelRunner

# EngineArgs fields that only the scheduler reads, so engines with other values can share one loaded model.
SCHEDULER_ONLY_ARGS = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "num_kvcache_blocks",
                       "max_waiting")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_path: str):
    """The checkpoint's Hugging Face tokenizer (read from the GGUF itself for GGUF files); None if it has none."""
    from transformers import AutoTokenizer

    gguf_path = gguf_file_of(model_path)
    if gguf_path is not None:
        return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    if not any(os.path.exists(os.path.join(model_path, name)) for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model_path)


class LLM:
    """A model and its engine for batch generation, like vLLM's `LLM`.

    `model`: a Hugging Face checkpoint directory, a .gguf file, or None for the embedded default.
    Keyword arguments are EngineArgs fields.
    """

    def __init__(self, model: str | None = None, **engine_args):
        known = set(EngineArgs.field_names())
        for name in engine_args:
            if name not in known:
                raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        args = EngineArgs(model=model, **engine_args)
        runner = ModelRunner(args)
        self._setup(args, runner, load_tokenizer(runner.model_path))

    def _setup(self, args: EngineArgs, runner: ModelRunner, tokenizer) -> None:
        self.args = args
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = self._eos_token_ids()
        generation_config = read_generation_config(runner.model_path) if os.path.isdir(runner.model_path) else None
        self.generation_defaults = sampling_defaults(model_display_name(runner.model_path), generation_config)
        runner.eos_token_ids = self.eos_token_ids  # the sampler keeps them out until min_tokens
        runner.enable_structured_output(tokenizer, self.eos_token_ids)
        config = args.scheduler_config(runner.max_model_len, runner.num_kvcache_blocks)
        self.engine = EngineCore(config, runner, self.eos_token_ids, runner.vocab_size)
        self._request_ids = itertools.count()

    def with_scheduler(self, **overrides) -> "LLM":
        """A new LLM sharing this one's loaded model and tokenizer, with its own KV cache and scheduler.

        Only SCHEDULER_ONLY_ARGS may change. Handy for comparing settings on one set of weights without
        loading them again; the two must not step at the same time (they share the model's layers).
        """
        for name in overrides:
            if name not in SCHEDULER_ONLY_ARGS:
                raise TypeError(f"with_scheduler() cannot change {name!r}; allowed: {', '.join(SCHEDULER_ONLY_ARGS)}")
        args = dataclasses.replace(self.args, **overrides)
        if "num_kvcache_blocks" not in overrides:
            args.num_kvcache_blocks = self.runner.num_kvcache_blocks
        clone = object.__new__(LLM)
        clone._setup(args, ModelRunner(args, share_model_with=self.runner), self.tokenizer)
        return clone

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes, if any (also done at interpreter exit); idempotent."""
        self.runner.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def _eos_token_ids(self) -> list[int]:
        ids = []
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        ids += [i for i in self.runner.eos_token_ids if i not in ids]
        return ids

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's defaults (services.common.generation_defaults), then `overrides`."""
        values = dict(self.generation_defaults)
        values["top_k"] = int(values["top_k"])
        return SamplingParams(**(values | overrides))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Generate for each prompt; returns dicts {text, token_ids, finish_reason, num_cached_tokens, logprobs,
        prompt_logprobs} in order (`logprobs`: one TokenLogprobs per token when the request asked, else None;
        `prompt_logprobs`: None first (nothing predicts the first prompt token), then one TokenLogprobs per
        prompt token when the request asked (sampling.num_prompt_logprobs), else None). With
        sampling n > 1 the dict is completion 0's plus "outputs": all n completions' dicts, by index.

        `prompts`: a str, a list of str, or a list of token-id lists. Without `sampling_params` each request
        samples with the model's defaults (default_sampling_params()). Every request is validated before
        any runs; an invalid one raises InvalidRequestError and nothing is generated.
        """
        prompt_ids = self._tokenize(prompts)
        params = self._sampling_list(sampling_params, len(prompt_ids))
        request_ids = self._add_all(prompt_ids, params)
        keys = [(rid, index) for rid, p in zip(request_ids, params) for index in range(p.n)]
        token_ids: dict[tuple[str, int], list[int]] = {key: [] for key in keys}
        logprobs: dict[tuple[str, int], list] = {key: [] for key in keys}
        prompt_logprobs: dict[str, list] = {}
        finals = {}
        try:
            with tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm) as progress:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        key = (output.request_id, output.index)
                        token_ids[key].extend(output.new_token_ids)
                        if output.logprobs:
                            logprobs[key].extend(output.logprobs)
                        if output.prompt_logprobs is not None:
                            prompt_logprobs[output.request_id] = [None, *output.prompt_logprobs.positions()]
                        if output.finished:
                            finals[key] = output
                        if output.request_finished:
                            progress.update(1)
        except BaseException:
            self._abort_all(request_ids)  # e.g. KeyboardInterrupt: leave the engine empty for the next call
            raise
        results = []
        for rid, p in zip(request_ids, params):
            completions = [self._result(token_ids[rid, i], finals[rid, i],
                                        logprobs[rid, i] if p.num_logprobs is not None else None) for i in range(p.n)]
            for completion in completions:  # the prompt's: completion 0 carries them
                completion["prompt_logprobs"] = prompt_logprobs.get(rid) if completion is completions[0] else None
            results.append(completions[0] if p.n == 1 else completions[0] | {"outputs": completions})
        return results

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None) -> list[dict]:
        """Apply the chat template (with the generation prompt) to one conversation or a list, then generate."""
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompt_ids = [self.chat_prompt_ids(conv, **(chat_template_kwargs or {})) for conv in conversations]
        return self.generate(prompt_ids, sampling_params, use_tqdm)

    def chat_prompt_ids(self, messages: list[dict], **kwargs) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's chat template, ready for the assistant."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stats(self) -> dict:
        """Engine counters: preemptions, cached prompt tokens, KV blocks free and total, and more."""
        return dataclasses.asdict(self.engine.stats())

    def _tokenize(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC) or not prompts:
            raise InvalidRequestError("prompts", "must be a str, a non-empty list of str, or of token-id lists")
        result = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise InvalidRequestError("prompts", "this model has no tokenizer: pass token ids")
                result.append(self.tokenizer.encode(prompt))
            elif isinstance(prompt, SequenceABC) and all(isinstance(t, Integral) for t in prompt):
                result.append([int(t) for t in prompt])
            else:
                raise InvalidRequestError("prompts", "each prompt must be a str or a list of token ids")
        return result

    def _sampling_list(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling_params() for _ in range(num_prompts)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise InvalidRequestError("sampling_params", f"{len(params)} given for {num_prompts} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams or a list of them")
        return params

    def _add_all(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[str]:
        """Add every request, or none: on the first invalid one, abort those already added and re-raise."""
        request_ids: list[str] = []
        try:
            for ids, sampling in zip(prompt_ids, params):
                request_id = f"llm-{next(self._request_ids)}"
                self.engine.add_request(request_id, ids, sampling)
                request_ids.append(request_id)
        except Exception:
            self._abort_all(request_ids)
            raise
        return request_ids

    def _abort_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _result(self, token_ids: list[int], final, logprobs: list | None) -> dict:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return {
            "text": text,
            "token_ids": token_ids,
            "finish_reason": final.finish_reason.name.lower(),
            "num_cached_tokens": final.num_cached_tokens,
            "logprobs": logprobs,
        }

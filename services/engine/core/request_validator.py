"""Whether a request could ever run on this engine, judged from configuration alone (no engine state)."""

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.validation import (
    MAX_TOKENS, PROMPT_TOKEN_IDS, STOP_TOKEN_IDS, check_fits, check_prompt, check_token_ids)
from services.engine.core.config import SchedulerConfig
from services.engine.core.errors import InvalidRequestError
from services.engine.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestValidator:
    """The limits a request must fit: vocabulary, context length and the whole KV cache.

    Immutable, so any thread may call `validate` while the engine steps; building one costs nothing
    (a process that only validates needs no engine).
    """

    vocab_size: int
    max_model_len: int
    block_size: int
    num_total_blocks: int

    @classmethod
    def for_config(cls, config: SchedulerConfig, vocab_size: int) -> "RequestValidator":
        return cls(vocab_size, config.max_model_len, config.block_size, config.num_kvcache_blocks)

    def validate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Raise InvalidRequestError, with the engine contract's field names, if the request can never run."""
        sampling.validate()
        check_prompt(PROMPT_TOKEN_IDS, prompt_token_ids, self.vocab_size, self.max_model_len)
        check_fits(len(prompt_token_ids), sampling.max_tokens, self.max_model_len)
        check_token_ids(STOP_TOKEN_IDS, sampling.stop_token_ids, self.vocab_size)
        self._check_kv_capacity(len(prompt_token_ids), sampling.max_tokens)

    def _check_kv_capacity(self, num_prompt_tokens: int, max_tokens: int) -> None:
        # NOTE: the last sampled token's KV is never computed, so a sequence holds at most
        # prompt + max_tokens - 1 tokens of KV.
        num_kv_tokens = num_prompt_tokens + max_tokens - 1
        if _ceil_div(num_kv_tokens, self.block_size) <= self.num_total_blocks:
            return
        prompt_too_big = _ceil_div(num_prompt_tokens, self.block_size) > self.num_total_blocks
        raise InvalidRequestError(
            PROMPT_TOKEN_IDS if prompt_too_big else MAX_TOKENS,
            f"needs {num_kv_tokens} tokens of KV cache but it holds only {self.num_total_blocks * self.block_size}",
        )


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)

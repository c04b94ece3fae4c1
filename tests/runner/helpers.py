"""Hand-built sequences for runner tests (no scheduler involved)."""

from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import Sequence


def make_seq(seq_id: int, token_ids: list[int], block_table: list[int], num_cached_tokens: int = 0,
             num_scheduled_tokens: int | None = None, sampling: SamplingParams | None = None,
             num_prompt_tokens: int = 0) -> Sequence:
    seq = Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(token_ids),
                   sampling=sampling or SamplingParams(temperature=0.0), num_prompt_tokens=num_prompt_tokens)
    seq.block_table = list(block_table)
    seq.num_cached_tokens = num_cached_tokens
    seq.num_scheduled_tokens = len(token_ids) - num_cached_tokens if num_scheduled_tokens is None \
        else num_scheduled_tokens
    return seq

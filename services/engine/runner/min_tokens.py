"""min_tokens: keep EOS and stop token ids out of the logits until a request has generated enough tokens."""

import torch

from services.engine.core.sequence import Sequence
from services.engine.runner.inputs import to_device


def banned_stop_tokens(seqs: list[Sequence], eos_token_ids: list[int]) -> tuple[list[int], list[int]]:
    """(rows, token ids) to ban this step: for each row whose sample index is below its min_tokens, its stop
    token ids and, unless ignore_eos, the EOS ids.

    NOTE: the sample index is num_completion_tokens, so with min_tokens=2 samples 0 and 1 are banned and
    sample 2 may stop (the scheduler's rule: min_tokens tokens precede the stop token).
    """
    rows: list[int] = []
    token_ids: list[int] = []
    for row, seq in enumerate(seqs):
        sampling = seq.sampling
        if seq.num_completion_tokens >= sampling.min_tokens:
            continue
        banned = list(sampling.stop_token_ids) if sampling.ignore_eos else [*sampling.stop_token_ids, *eos_token_ids]
        rows += [row] * len(banned)
        token_ids += banned
    return rows, token_ids


def suppress_stop_tokens_below_min(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> None:
    """Set the banned (row, token) logits [B, V] to -inf in place, in one device op with no host sync."""
    rows, token_ids = banned_stop_tokens(seqs, eos_token_ids)
    if not rows:
        return
    indices = (to_device(rows, torch.int64, logits.device), to_device(token_ids, torch.int64, logits.device))
    logits.index_put_(indices, logits.new_full((1,), float("-inf")))

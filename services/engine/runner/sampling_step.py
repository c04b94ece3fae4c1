"""One step's sampling, in order: raw log-probabilities, penalties, min_tokens bans, then the sampler.

Each stage is batched over the rows that need it and skipped outright when no row does, so a plain batch pays
for none of them. Nothing here waits on the device.
"""

import torch

from services.engine.core.sequence import Sequence
from services.engine.runner.logprobs import DeviceLogprobs, gather_logprobs, make_logprobs_batch, raw_logprobs
from services.engine.runner.min_tokens import suppress_stop_tokens_below_min
from services.engine.runner.penalties import PenaltyState
from services.engine.runner.sampler import Sampler
from services.engine.runner.sampling_batch import make_sampling_batch


class StepSampler:
    """Turns a step's logits [B, V] into token ids [B] (and log-probabilities for the rows that ask)."""

    def __init__(self, seed: int, vocab_size: int, device: torch.device):
        self.sampler = Sampler(seed, device)
        self.penalties = PenaltyState(vocab_size, device)
        self.vocab_size = vocab_size
        self.device = device

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               eos_token_ids: list[int]) -> tuple[torch.Tensor, DeviceLogprobs | None]:
        """Token ids [B] for `seqs` (row i samples for seqs[i]); edits `logits` in place."""
        logprobs_batch = make_logprobs_batch(seqs, self.device)
        logprobs = raw_logprobs(logits, logprobs_batch) if logprobs_batch is not None else None  # [R, V]
        penalty_batch = self.penalties.prepare(seqs)
        if penalty_batch is not None:
            self.penalties.apply(logits, penalty_batch)
        suppress_stop_tokens_below_min(logits, seqs, eos_token_ids)
        token_ids = self.sampler.sample(logits, make_sampling_batch(seqs, self.vocab_size, self.device))  # [B]
        if penalty_batch is not None:
            self.penalties.record(token_ids, penalty_batch)
        if logprobs_batch is None:
            return token_ids, None
        return token_ids, gather_logprobs(logprobs, token_ids, logprobs_batch)


def worst_case_feature_memory(num_rows: int, vocab_size: int, device: torch.device) -> list[torch.Tensor]:
    """Tensors as large as what logprobs ([B, V] fp32 while sampling) and the penalty state ([slots, V] int32 +
    bool, kept) take with every row asking: held during memory profiling so the KV cache leaves room for them."""
    return [torch.empty(num_rows, vocab_size, dtype=dtype, device=device)
            for dtype in (torch.float32, torch.int32, torch.bool)]

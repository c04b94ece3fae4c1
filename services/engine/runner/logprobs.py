"""Log-probabilities of the sampled tokens and their top alternatives, for the rows that ask for them.

They are the model's raw distribution (vLLM's default "raw logprobs"): one log_softmax of the logits as the model
produced them, before penalties, min_tokens bans, temperature, top-k, top-p and min-p. The work is a few batched
device ops over the asking rows only (index_select, log_softmax, gather, topk); a step where no row asks does
none of it.
"""

from dataclasses import dataclass

import torch

from services.engine.core.interfaces import TokenLogprobs
from services.engine.core.sequence import Sequence
from services.engine.runner.inputs import to_device


@dataclass(slots=True)
class LogprobsBatch:
    """The rows of one sampling step that asked for log-probabilities."""

    rows: torch.Tensor  # int64 [R], rows of the logits
    seq_ids: list[int]  # [R]
    num_top: list[int]  # [R], alternatives each row asked for
    max_top: int


@dataclass(slots=True)
class DeviceLogprobs:
    """A step's log-probabilities, still on the device (nothing here has waited on it)."""

    batch: LogprobsBatch
    sampled: torch.Tensor  # float32 [R]
    top_values: torch.Tensor  # float32 [R, K]
    top_ids: torch.Tensor  # int64 [R, K]

    def to_host(self) -> dict[int, TokenLogprobs]:
        """seq_id -> TokenLogprobs, each row cut to the alternatives it asked for."""
        sampled = self.sampled.tolist()
        top_values = self.top_values.tolist()
        top_ids = self.top_ids.tolist()
        batch = self.batch
        return {seq_id: TokenLogprobs(logprob, ids[:k], values[:k])
                for seq_id, k, logprob, ids, values in zip(batch.seq_ids, batch.num_top, sampled, top_ids, top_values)}


def make_logprobs_batch(seqs: list[Sequence], device: torch.device) -> LogprobsBatch | None:
    """The asking rows of the sampled `seqs`, or None when no row asks."""
    rows = [row for row, seq in enumerate(seqs) if seq.sampling.num_logprobs is not None]
    if not rows:
        return None
    num_top = [seqs[row].sampling.num_logprobs for row in rows]
    return LogprobsBatch(to_device(rows, torch.int64, device), [seqs[row].seq_id for row in rows], num_top,
                         max(num_top))


def raw_logprobs(logits: torch.Tensor, batch: LogprobsBatch) -> torch.Tensor:
    """log_softmax [R, V] (fp32) of the asking rows of `logits` [B, V]; a copy, so later in-place edits of the
    logits (penalties, bans) do not reach it."""
    return logits.index_select(0, batch.rows).float().log_softmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, batch: LogprobsBatch) -> DeviceLogprobs:
    """The sampled ids' [B] log-probabilities and the top max_top alternatives of each asking row."""
    sampled_ids = token_ids.index_select(0, batch.rows)  # [R]
    sampled = logprobs.gather(1, sampled_ids[:, None]).squeeze(1)  # [R]
    top_values, top_ids = logprobs.topk(batch.max_top, dim=-1)  # [R, K]
    return DeviceLogprobs(batch, sampled, top_values, top_ids)

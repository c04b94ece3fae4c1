"""Repetition, presence and frequency penalties, applied on the device from token counts kept there.

Definitions (pinned by tests/runner/test_penalties.py against the references):
- repetition (transformers' RepetitionPenaltyLogitsProcessor): for every token in the prompt or the output so far,
  a negative logit is multiplied by the penalty and any other divided by it;
- presence and frequency (OpenAI's): logit -= presence * [count > 0] + frequency * count, with count the token's
  occurrences in the output so far.

A step with no penalized row costs nothing here (`prepare` returns None after one pass over the rows' flags).
"""

from dataclasses import dataclass

import torch

from services.engine.core.sequence import Sequence
from services.engine.runner.inputs import to_device

_FIRST_SLOTS = 8


@dataclass(slots=True)
class PenaltyBatch:
    """The penalized rows of one sampling step: their rows in the logits, their slots and their values [R]."""

    rows: torch.Tensor  # int64 [R]
    slots: torch.Tensor  # int64 [R]
    repetition: torch.Tensor  # float32 [R]
    presence: torch.Tensor  # float32 [R]
    frequency: torch.Tensor  # float32 [R]
    use_repetition: bool
    use_additive: bool


class PenaltyState:
    """Per-sequence token statistics on the device, kept across steps so no step re-reads a sequence's tokens.

    Each penalized sequence owns a slot: a row of `output_counts` [slots, V] (how often it generated each token)
    and of `prompt_seen` [slots, V] (whether each token is in its prompt). The slot is filled when the sequence is
    first sampled, bumped after every step with the sampled ids (one scatter, no host sync) and released once the
    sequence has finished. NOTE: a sequence keeps its slot through preemption: its tokens do not change.
    Storage grows by doubling: 5 bytes x vocab per slot.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)  # [slots, V]
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [slots, V]
        self._owners: dict[int, tuple[int, Sequence]] = {}  # seq_id -> (slot, sequence)
        self._free: list[int] = []

    @property
    def num_owned_slots(self) -> int:
        return len(self._owners)

    def prepare(self, seqs: list[Sequence]) -> PenaltyBatch | None:
        """The step's PenaltyBatch for the sampled `seqs` (None when no row is penalized), filling new slots."""
        rows = [row for row, seq in enumerate(seqs) if seq.sampling.has_penalties]
        if self._owners:
            self._release_finished()
        if not rows:
            return None
        penalized = [seqs[row] for row in rows]
        self._claim([seq for seq in penalized if seq.seq_id not in self._owners])
        params = [seq.sampling for seq in penalized]
        device = self.device
        return PenaltyBatch(
            rows=to_device(rows, torch.int64, device),
            slots=to_device([self._owners[seq.seq_id][0] for seq in penalized], torch.int64, device),
            repetition=to_device([p.repetition_penalty for p in params], torch.float32, device),
            presence=to_device([p.presence_penalty for p in params], torch.float32, device),
            frequency=to_device([p.frequency_penalty for p in params], torch.float32, device),
            use_repetition=any(p.repetition_penalty != 1.0 for p in params),
            use_additive=any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params),
        )

    def apply(self, logits: torch.Tensor, batch: PenaltyBatch) -> None:
        """Penalize the batch's rows of `logits` [B, V] in place (computed in fp32)."""
        scores = logits.index_select(0, batch.rows).float()  # [R, V]
        counts = self.output_counts.index_select(0, batch.slots)  # [R, V]
        generated = counts > 0  # [R, V]
        if batch.use_repetition:
            seen = generated | self.prompt_seen.index_select(0, batch.slots)  # [R, V]
            penalty = batch.repetition[:, None]
            scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
        if batch.use_additive:
            scores = scores - batch.frequency[:, None] * counts - batch.presence[:, None] * generated
        logits.index_copy_(0, batch.rows, scores.to(logits.dtype))

    def record(self, token_ids: torch.Tensor, batch: PenaltyBatch) -> None:
        """Count the step's sampled ids [B] for the penalized rows (their slots are distinct: no collisions)."""
        sampled = token_ids.index_select(0, batch.rows)  # [R]
        ones = torch.ones_like(sampled, dtype=torch.int32)
        self.output_counts.index_put_((batch.slots, sampled), ones, accumulate=True)

    def _claim(self, seqs: list[Sequence]) -> None:
        """Give each sequence a slot filled from its prompt and its output so far, in a few device ops."""
        if not seqs:
            return
        while len(self._free) < len(seqs):
            self._grow()
        slots = [self._free.pop() for _ in seqs]
        prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
        for slot, seq in zip(slots, seqs):
            self._owners[seq.seq_id] = (slot, seq)
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            prompt_rows += [slot] * len(prompt)
            prompt_ids += prompt
            output = seq.completion_token_ids
            output_rows += [slot] * len(output)
            output_ids += output
        slots_t = to_device(slots, torch.int64, self.device)
        self.prompt_seen.index_fill_(0, slots_t, False)
        self.output_counts.index_fill_(0, slots_t, 0)
        self.prompt_seen.index_put_(self._indices(prompt_rows, prompt_ids), torch.ones((), dtype=torch.bool,
                                                                                        device=self.device))
        if output_ids:
            ones = torch.ones(len(output_ids), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(self._indices(output_rows, output_ids), ones, accumulate=True)

    def _indices(self, rows: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return to_device(rows, torch.int64, self.device), to_device(ids, torch.int64, self.device)

    def _release_finished(self) -> None:
        for seq_id, (slot, seq) in list(self._owners.items()):
            if seq.is_finished:
                del self._owners[seq_id]
                self._free.append(slot)

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        new = max(_FIRST_SLOTS, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.output_counts
        seen[:old] = self.prompt_seen
        self.output_counts, self.prompt_seen = counts, seen
        self._free.extend(range(new - 1, old - 1, -1))

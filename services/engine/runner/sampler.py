"""Vectorized token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

`Sampler.sample` never waits on the device; `__call__` adds the step's one host sync (`.tolist()`).
An all-greedy batch builds no parameter tensors at all. Sampling uses the exponential race: with q ~ Exp(1)
i.i.d. per token, argmax(probs / q) is distributed as probs. Rows with a seed draw q from a generator
seeded by (seed, sample index) alone, so their draws never depend on the rest of the batch.
"""

from dataclasses import dataclass

import torch

from services.engine.core.sequence import Sequence
from services.engine.runner.inputs import to_device

# Temperatures below this are treated as greedy (dividing by them would overflow the logits).
MIN_TEMPERATURE = 1e-5
_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of the sequences being sampled, as device tensors [B].

    Disabled filters hold neutral values: top_k = vocab size, top_p = +inf, min_p = 0. When every row is
    greedy (all_greedy) the tensors are None: greedy needs none of them.
    """

    temperatures: torch.Tensor | None
    top_ks: torch.Tensor | None
    top_ps: torch.Tensor | None
    min_ps: torch.Tensor | None
    is_greedy: torch.Tensor | None
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    seeded_rows: list[tuple[int, int, int]]  # (row, seed, sample index)


GREEDY_BATCH = SamplingBatch(None, None, None, None, None, True, False, False, False, [])


def make_sampling_batch(seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
    params = [seq.sampling for seq in seqs]
    greedy = [p.temperature < MIN_TEMPERATURE for p in params]
    if all(greedy):
        return GREEDY_BATCH
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    sampled = [p for p, g in zip(params, greedy) if not g]
    return SamplingBatch(
        temperatures=to_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32, device),
        top_ks=to_device(top_ks, torch.int64, device),
        top_ps=to_device([p.top_p if p.top_p < 1.0 else float("inf") for p in params], torch.float32, device),
        min_ps=to_device([p.min_p for p in params], torch.float32, device),
        is_greedy=to_device(greedy, torch.bool, device),
        all_greedy=False,
        use_top_k=any(0 < p.top_k < vocab_size for p in sampled),
        use_top_p=any(p.top_p < 1.0 for p in sampled),
        use_min_p=any(p.min_p > 0.0 for p in sampled),
        seeded_rows=[(row, seq.sampling.seed, seq.num_completion_tokens)
                     for row, (seq, g) in enumerate(zip(seqs, greedy)) if not g and seq.sampling.seed is not None],
    )


def suppress_stop_tokens_below_min(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> None:
    """Rows still short of min_tokens cannot pick EOS (unless ignore_eos) or a stop token id (in place)."""
    for row, seq in enumerate(seqs):
        sampling = seq.sampling
        if seq.num_completion_tokens >= sampling.min_tokens:
            continue
        banned = list(sampling.stop_token_ids) + ([] if sampling.ignore_eos else list(eos_token_ids))
        if banned:
            logits[row, banned] = float("-inf")


def seeded_generator(seed: int, sample_index: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * _SEED_MIX + sample_index) & _SEED_MASK)
    return generator


class Sampler:
    """Turns logits [B, V] into one token id per row. Unseeded rows share `generator`."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
        return self.sample(logits, batch).tolist()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token ids [B] on the logits' device, without waiting on it."""
        greedy_ids = logits.argmax(dim=-1)  # [B]
        if batch.all_greedy:
            return greedy_ids
        probs = self.filtered_probs(logits.float(), batch)
        sampled_ids = (probs / self._exponential(probs.shape, batch)).argmax(dim=-1)
        return torch.where(batch.is_greedy, greedy_ids, sampled_ids)

    @staticmethod
    def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Probabilities after temperature, then top-k, top-p (over the top-k survivors) and min-p."""
        logits = logits / batch.temperatures[:, None]
        if batch.use_top_k or batch.use_top_p:
            logits = _mask_top_k_top_p(logits, batch)
        probs = logits.softmax(dim=-1)  # [B, V]
        if batch.use_min_p:
            threshold = batch.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _exponential(self, shape: torch.Size, batch: SamplingBatch) -> torch.Tensor:
        # -log(u) with u in [0, 1) is Exp(1) and never 0 (u = 0 gives inf: that token simply loses).
        q = -torch.rand(shape, generator=self.generator, device=self.device).log_()  # [B, V]
        for row, seed, sample_index in batch.seeded_rows:
            generator = seeded_generator(seed, sample_index, self.device)
            q[row] = -torch.rand(shape[1], generator=generator, device=self.device).log_()
        return q


def _mask_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    mask = ranks >= batch.top_ks[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    if batch.use_top_p:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # A token survives while the mass ranked above it is below top_p; the top token always does.
        sorted_logits = sorted_logits.masked_fill(mass_before >= batch.top_ps[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def worst_case_sampling_batch(num_rows: int, vocab_size: int, device: torch.device) -> SamplingBatch:
    """Every filter on for every row (the most memory a sampling step takes; for profiling)."""
    def full(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((num_rows,), value, dtype=dtype, device=device)

    return SamplingBatch(
        temperatures=full(0.7, torch.float32), top_ks=full(max(1, vocab_size // 2), torch.int64),
        top_ps=full(0.9, torch.float32), min_ps=full(0.01, torch.float32), is_greedy=full(False, torch.bool),
        all_greedy=False, use_top_k=True, use_top_p=True, use_min_p=True, seeded_rows=[])

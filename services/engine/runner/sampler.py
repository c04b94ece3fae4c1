"""Vectorized token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Filter boundaries (pinned by tests/runner/test_sampler.py): top-k keeps ranks < k; top-p keeps a token while
the probability mass ranked strictly above it is < top_p, so the kept head is the smallest whose mass
reaches top_p; min-p keeps tokens with probability >= min_p * the top probability.

`Sampler.sample` never waits on the device; `__call__` adds the step's one host sync (`.tolist()`).
An all-greedy batch builds no parameter tensors at all. Sampling uses the exponential race: with q ~ Exp(1)
i.i.d. per token, argmax(probs / q) is distributed as probs. Rows with a seed draw q from a generator
seeded by (seed, sample index) alone, so their draws never depend on the rest of the batch.
"""

import torch

from services.engine.runner.sampling_batch import SamplingBatch

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


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

"""Per-row sampling parameters of one step, gathered from the sequences into device tensors."""

from dataclasses import dataclass

import torch

from services.engine.core.sequence import Sequence
from services.engine.runner.inputs import to_device


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
    greedy = [p.is_greedy for p in params]
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


def worst_case_sampling_batch(num_rows: int, vocab_size: int, device: torch.device) -> SamplingBatch:
    """Every filter on for every row (the most memory a sampling step takes; for profiling)."""
    def full(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((num_rows,), value, dtype=dtype, device=device)

    return SamplingBatch(
        temperatures=full(0.7, torch.float32), top_ks=full(max(1, vocab_size // 2), torch.int64),
        top_ps=full(0.9, torch.float32), min_ps=full(0.01, torch.float32), is_greedy=full(False, torch.bool),
        all_greedy=False, use_top_k=True, use_top_p=True, use_min_p=True, seeded_rows=[])

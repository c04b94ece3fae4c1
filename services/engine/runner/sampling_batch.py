"""Per-row sampling parameters of one step, gathered from the sequences into device tensors, and the seeded
rows' uniforms (a counter-based hash of (seed, sample index), computed on the host)."""

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.core.sequence import Sequence
from services.engine.runner.inputs import to_device

_U64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of the sequences being sampled, as device tensors [B].

    Disabled filters hold neutral values: top_k = vocab size, top_p = +inf, min_p = 0. When every row is
    greedy (all_greedy) the tensors are None: greedy needs none of them. is_greedy is None when no row is
    greedy; is_seeded (bool) and seeded_uniforms (float64 in [0, 1), meaningful where is_seeded) are None when
    no row has a seed.
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
    is_seeded: torch.Tensor | None = None
    seeded_uniforms: torch.Tensor | None = None


GREEDY_BATCH = SamplingBatch(None, None, None, None, None, True, False, False, False)


def make_sampling_batch(seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
    params = [seq.sampling for seq in seqs]
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        return GREEDY_BATCH
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    sampled = [p for p, g in zip(params, greedy) if not g]
    batch = SamplingBatch(
        temperatures=to_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32, device),
        top_ks=to_device(top_ks, torch.int64, device),
        top_ps=to_device([p.top_p if p.top_p < 1.0 else float("inf") for p in params], torch.float32, device),
        min_ps=to_device([p.min_p for p in params], torch.float32, device),
        is_greedy=to_device(greedy, torch.bool, device) if any(greedy) else None,
        all_greedy=False,
        use_top_k=any(0 < p.top_k < vocab_size for p in sampled),
        use_top_p=any(p.top_p < 1.0 for p in sampled),
        use_min_p=any(p.min_p > 0.0 for p in sampled),
    )
    is_seeded = [p.seed is not None and not g for p, g in zip(params, greedy)]
    if any(is_seeded):
        seeds = np.array([p.seed & _U64 if s else 0 for p, s in zip(params, is_seeded)], dtype=np.uint64)
        sample_indices = np.array([seq.num_completion_tokens for seq in seqs], dtype=np.uint64)
        batch.is_seeded = to_device(is_seeded, torch.bool, device)
        batch.seeded_uniforms = to_device(seeded_uniforms(seeds, sample_indices), torch.float64, device)
    return batch


def seeded_uniforms(seeds: np.ndarray, sample_indices: np.ndarray) -> np.ndarray:
    """Uniforms [B] float64 in [0, 1): draw number `sample_indices[b]` of the stream keyed by `seeds[b]`
    (uint64 arrays [B]), a pure function of that pair.

    The stream is SplitMix64 started from the state mix64(seed): its output i is mix64(state + (i + 1) * gamma),
    reachable in O(1), and mix64 being a bijection gives every seed its own start (seeds s and s + 1, as the
    n > 1 rule uses, are far apart). The top 53 bits make the float. numpy's uint64 array arithmetic wraps.
    """
    state = _mix64(seeds) + (sample_indices + np.uint64(1)) * _GAMMA
    return (_mix64(state) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def worst_case_sampling_batch(num_rows: int, vocab_size: int, device: torch.device) -> SamplingBatch:
    """Every filter on for every row (the most memory a sampling step takes; for profiling)."""
    def full(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((num_rows,), value, dtype=dtype, device=device)

    return SamplingBatch(
        temperatures=full(0.7, torch.float32), top_ks=full(max(1, vocab_size // 2), torch.int64),
        top_ps=full(0.9, torch.float32), min_ps=full(0.01, torch.float32), is_greedy=full(False, torch.bool),
        all_greedy=False, use_top_k=True, use_top_p=True, use_min_p=True,
        is_seeded=full(True, torch.bool), seeded_uniforms=full(0.5, torch.float64))

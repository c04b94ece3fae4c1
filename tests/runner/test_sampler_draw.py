"""The sampler's random draw: inverse-CDF sampling from one uniform per row, seeded rows' uniforms hashed from
(seed, sample index), zero-probability tokens never drawn, no per-row generator and no host sync."""

import numpy as np
import pytest
import torch

import services.engine.runner.sampler as sampler_module
from services.engine.core.sampling_params import SamplingParams
from services.engine.runner.sampler import Sampler, sample_inverse_cdf
from services.engine.runner.sampling_batch import make_sampling_batch, seeded_uniforms
from tests.runner.helpers import make_seq

CPU = torch.device("cpu")
PROMPT = [1, 2, 3]


def _seqs(params: list[SamplingParams], sample_indices: list[int] | None = None):
    indices = sample_indices or [0] * len(params)
    return [make_seq(row, PROMPT + [7] * index, [0], sampling=p, num_prompt_tokens=len(PROMPT))
            for row, (p, index) in enumerate(zip(params, indices))]


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
            sample_indices: list[int] | None = None) -> list[int]:
    return sampler(logits, make_sampling_batch(_seqs(params, sample_indices), logits.shape[1], CPU))


def _chi_square(ids: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the draws `ids` against probs [V] (normalized here)."""
    expected = (probs / probs.sum()).double() * len(ids)
    observed = torch.bincount(torch.tensor(ids), minlength=probs.numel()).double()
    assert not observed[expected == 0].any(), "a zero-probability token was drawn"
    kept = expected > 0
    return float(((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum()), int(kept.sum()) - 1


# Deterministic (fixed seeds), so not flaky; the bound is about 6 standard deviations above the mean (= df).
def _bound(df: int) -> float:
    return df + 6 * (2 * df) ** 0.5


FILTERED = dict(temperature=0.8, top_k=12, top_p=0.95, min_p=0.1)  # every filter cuts something below


def _filtered_row(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return Sampler.filtered_probs(logits_row[None].float(), make_sampling_batch(_seqs([params]), 16, CPU))[0]


def test_unseeded_frequencies_match_the_filtered_distribution():
    logits_row = torch.linspace(2.0, -2.5, 16)
    params = SamplingParams(**FILTERED)
    probs = _filtered_row(logits_row, params)
    assert probs.sum() < 0.999 and 4 < int(probs.gt(0).sum()) < 12  # min-p left mass out: the total matters
    num_draws = 20000
    ids = _sample(Sampler(3, CPU), logits_row.expand(num_draws, -1).contiguous(), [params] * num_draws)
    statistic, df = _chi_square(ids, probs)
    assert statistic < _bound(df), (statistic, df)


def test_seeded_frequencies_across_seeds_match_the_filtered_distribution():
    logits_row = torch.linspace(1.5, -3.0, 16)
    probs = _filtered_row(logits_row, SamplingParams(**FILTERED))
    num_draws = 20000
    params = [SamplingParams(**FILTERED, seed=seed) for seed in range(num_draws)]
    ids = _sample(Sampler(0, CPU), logits_row.expand(num_draws, -1).contiguous(), params)
    statistic, df = _chi_square(ids, probs)
    assert statistic < _bound(df), (statistic, df)


@pytest.mark.parametrize("axis", ["sample_index", "seed"])
def test_seeded_uniforms_are_uniform_along_each_axis(axis):
    count = np.arange(50000, dtype=np.uint64)
    fixed = np.full(count.shape, 12345, dtype=np.uint64)
    uniforms = seeded_uniforms(fixed, count) if axis == "sample_index" else seeded_uniforms(count, fixed)
    assert uniforms.min() >= 0.0 and uniforms.max() < 1.0
    observed = np.bincount((uniforms * 20).astype(np.int64), minlength=20)
    expected = len(uniforms) / 20
    assert ((observed - expected) ** 2 / expected).sum() < _bound(19)


def test_seeded_uniforms_are_a_pure_function_of_seed_and_index():
    seeds = np.array([5, 5, 6, 2**64 - 1, 5], dtype=np.uint64)
    indices = np.array([0, 1, 0, 0, 0], dtype=np.uint64)
    uniforms = seeded_uniforms(seeds, indices)
    assert uniforms[0] == uniforms[4] == seeded_uniforms(seeds[:1], indices[:1])[0]
    assert len(set(uniforms[:4].tolist())) == 4


def test_a_seeded_row_draws_the_same_tokens_alone_and_anywhere_in_any_batch():
    logits = torch.randn(9, 500, generator=torch.Generator().manual_seed(0)) * 2
    mine = SamplingParams(temperature=1.1, top_p=0.9, seed=2**70 + 31)  # seeds past 64 bits are used mod 2**64
    steps = range(6)
    alone = [_sample(Sampler(0, CPU), logits[4:5], [mine], [step])[0] for step in steps]
    assert len(set(alone)) > 1, "the sample index must feed the draw"
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=9), SamplingParams(top_k=5),
              SamplingParams(temperature=1.1, top_p=0.9, seed=31), SamplingParams(min_p=0.1)]
    for position, batch_size, sampler_seed in ((0, 2, 1), (3, 6, 2), (8, 9, 3)):
        params = [others[i % len(others)] for i in range(batch_size)]
        params[position] = mine
        batch_logits = torch.randn(batch_size, 500, generator=torch.Generator().manual_seed(position))
        batch_logits[position] = logits[4]
        sampler = Sampler(sampler_seed, CPU)
        indices = [[step if row == position else 3 * step + row for row in range(batch_size)] for step in steps]
        in_batch = [_sample(sampler, batch_logits, params, row_indices)[position] for row_indices in indices]
        in_batch_same_index = [_sample(sampler, batch_logits, params, [step] * batch_size)[position]
                               for step in steps]
        assert in_batch == alone == in_batch_same_index, position


# The rounding edges: u at both ends of [0, 1) (and 1.0 itself) with zero-probability tokens at both ends.

EDGE_UNIFORMS = [0.0, 2.0 ** -53, 0.5, 1.0 - 2.0 ** -53, 1.0]


@pytest.mark.parametrize("exact_zero_steps", [True, False])
def test_zero_probability_tokens_are_never_drawn_at_the_edges(exact_zero_steps):
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0],  # total exactly 1.0 in fp32
                          [0.0, 0.3, 0.0, 0.0, 0.0, 0.1, 0.2, 0.0],  # total 0.6, not a power of two
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-30]])  # one tiny survivor, last
    for u in EDGE_UNIFORMS:
        ids = sample_inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64), exact_zero_steps)
        assert probs[torch.arange(3), ids].gt(0).all(), (u, ids)
    ends = sample_inverse_cdf(probs.expand(2, 3, 8).reshape(6, 8),
                              torch.tensor([0.0] * 3 + [1.0 - 2.0 ** -53] * 3, dtype=torch.float64), exact_zero_steps)
    assert ends.tolist() == [2, 1, 7, 5, 6, 7]  # the first and the last nonzero token of each row


def _cumsum_with_parallel_scan_ulps(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """CPU cumsum plus the ulp a tree-ordered scan can add where a zero follows mass (see the sampler's NOTE)."""
    cdf = _REAL_CUMSUM(self, dim=dim)
    after_mass = (self == 0) & (cdf > 0)
    return torch.where(after_mass, torch.nextafter(cdf, torch.full_like(cdf, 2.0)), cdf)


_REAL_CUMSUM = torch.Tensor.cumsum


def test_a_parallel_scans_ulp_steps_at_zeros_are_removed(monkeypatch):
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.0, 0.125, 0.125]])  # cdf exact in fp32, total 1.0
    monkeypatch.setattr(torch.Tensor, "cumsum", _cumsum_with_parallel_scan_ulps)
    # u * total landing exactly on cdf[1] = 0.25 falls in the spurious step of token 2 (a zero) when unguarded.
    u = torch.tensor([0.25], dtype=torch.float64)
    assert sample_inverse_cdf(probs, u, exact_zero_steps=True).tolist() == [2]  # the hazard is real
    for value in EDGE_UNIFORMS + [0.25, 0.75]:
        ids = sample_inverse_cdf(probs, torch.tensor([value], dtype=torch.float64), exact_zero_steps=False)
        assert probs[0, ids].gt(0).all(), value


def test_the_cpu_scan_adds_zeros_exactly():
    # The CPU path relies on it (exact_zero_steps=True): a torch whose CPU cumsum changed would fail here.
    probs = torch.randn(64, 30000, generator=torch.Generator().manual_seed(1)).softmax(-1)
    probs[:, torch.randperm(30000, generator=torch.Generator().manual_seed(2))[:20000]] = 0.0
    cdf = probs.cumsum(-1)
    zero = probs[:, 1:] == 0
    assert torch.equal(cdf[:, 1:][zero], cdf[:, :-1][zero])
    assert bool((cdf[:, 1:] >= cdf[:, :-1]).all())


def test_a_step_draws_b_uniforms_and_no_generator_per_row(monkeypatch):
    num_rows, vocab = 6, 4096
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=row if row % 2 else None) for row in range(num_rows)]
    batch = make_sampling_batch(_seqs(params), vocab, CPU)
    sampler = Sampler(7, CPU)
    reference = torch.Generator().manual_seed(7)
    torch.rand(num_rows, generator=reference, dtype=torch.float64)
    requested, generators = [], []
    real_rand, real_generator = torch.rand, torch.Generator
    monkeypatch.setattr(torch, "rand", lambda *a, **k: requested.append(a) or real_rand(*a, **k))
    monkeypatch.setattr(torch, "Generator", lambda *a, **k: generators.append(a) or real_generator(*a, **k))
    sampler.sample(logits, batch)
    assert requested == [(num_rows,)] and generators == []
    assert torch.equal(sampler.generator.get_state(), reference.get_state())  # exactly B doubles consumed
    assert not hasattr(sampler_module, "seeded_generator")


def test_sampling_reads_nothing_back_from_the_tensors(monkeypatch):
    """The CPU stand-in for the CUDA no-sync test: any read of a tensor's value on the host raises."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=20, seed=3),
              SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05), SamplingParams(temperature=0.9, seed=4)]
    logits = torch.randn(len(params), 300, generator=torch.Generator().manual_seed(5))
    batch = make_sampling_batch(_seqs(params), 300, CPU)

    def host_read(*_args, **_kwargs):
        raise AssertionError("host read of a tensor")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    token_ids = Sampler(0, CPU).sample(logits, batch)
    monkeypatch.undo()
    assert token_ids.shape == (len(params),) and token_ids[0] == logits[0].argmax()

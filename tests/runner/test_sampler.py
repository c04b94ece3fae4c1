"""The vectorized sampler: greedy, filters, temperature and per-request seeds.

Every test runs twice: with top-p's candidates (sampler.TOP_P_CANDIDATES) above this vocabulary, so top-p sorts
the whole of it, and with just 2 candidates, so rows go through _mask_among_candidates (and its fall-back to
the full sort whenever the survivors do not fit among them): both ways must filter alike.
"""

import math

import pytest
import torch

from services.engine.runner import sampler as sampler_module

from services.engine.core.sampling_params import MIN_TEMPERATURE, SamplingParams
from services.engine.runner.sampler import Sampler
from services.engine.runner.sampling_batch import make_sampling_batch
from tests.runner.helpers import make_seq

CPU = torch.device("cpu")
VOCAB = 1000


@pytest.fixture(autouse=True, params=[VOCAB + 24, 2], ids=["full-sort", "2-candidates"])
def top_p_candidates(request, monkeypatch):
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", request.param)
    return request.param


def _seqs(params: list[SamplingParams], num_completion_tokens: int = 0):
    prompt = [1, 2, 3]
    return [make_seq(i, prompt + [7] * num_completion_tokens, [0], sampling=p, num_prompt_tokens=len(prompt))
            for i, p in enumerate(params)]


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], num_completion_tokens: int = 0):
    return sampler(logits, make_sampling_batch(_seqs(params, num_completion_tokens), logits.shape[1], CPU))


def _random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return Sampler.filtered_probs(logits, make_sampling_batch(_seqs(params), logits.shape[1], CPU))


def test_greedy_is_argmax():
    logits = _random_logits(5)
    assert _sample(Sampler(0, CPU), logits, [SamplingParams(temperature=0.0)] * 5) == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy_whatever_the_seed():
    logits = _random_logits(6, seed=1)
    for seed in range(3):
        params = [SamplingParams(temperature=1.3, top_k=1, seed=seed if i % 2 else None) for i in range(6)]
        assert _sample(Sampler(seed, CPU), logits, params) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_sampled_batch():
    logits = _random_logits(4, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)] * 2
    ids = _sample(Sampler(0, CPU), logits, params)
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()


def test_top_k_keeps_the_k_largest():
    logits = _random_logits(3, seed=3)
    probs = _filtered(logits, [SamplingParams(top_k=5), SamplingParams(top_k=1), SamplingParams()])
    for row, k in ((0, 5), (1, 1)):
        assert set(probs[row].nonzero().flatten().tolist()) == set(logits[row].topk(k).indices.tolist())
    assert probs[2].gt(0).all()


def test_top_p_keeps_the_smallest_head_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = _filtered(logits, [SamplingParams(top_p=0.7)])
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = _filtered(logits, [SamplingParams(top_p=0.85)])
    assert probs.gt(0).tolist() == [[True, True, True, False]]
    probs = _filtered(logits, [SamplingParams(top_p=0.4)])
    assert probs.gt(0).tolist() == [[True, False, False, False]]


def test_top_p_applies_to_the_top_k_survivors():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-2 renormalizes to [4/7, 3/7]; top-p 0.5 then keeps only the first.
    probs = _filtered(logits, [SamplingParams(top_k=2, top_p=0.5)])
    assert probs.gt(0).tolist() == [[True, False, False, False]]


def test_min_p_masks_tokens_below_a_fraction_of_the_top():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]).log()
    probs = _filtered(logits, [SamplingParams(min_p=0.2), SamplingParams(min_p=0.5)])
    assert probs.gt(0).tolist() == [[True, True, True, False], [True, True, False, False]]


def test_samples_never_come_from_masked_tokens():
    logits = _random_logits(64, seed=4)
    params = [SamplingParams(temperature=2.0, top_k=3, seed=i if i % 3 else None) for i in range(64)]
    ids = _sample(Sampler(5, CPU), logits, params)
    allowed = logits.topk(3).indices
    assert all(token in allowed[row].tolist() for row, token in enumerate(ids))


def _frequencies(logits_row: torch.Tensor, temperature: float, num_draws: int = 4000) -> torch.Tensor:
    logits = logits_row.expand(num_draws, -1).contiguous()
    ids = _sample(Sampler(11, CPU), logits, [SamplingParams(temperature=temperature)] * num_draws)
    return torch.bincount(torch.tensor(ids), minlength=logits.shape[1]).float() / num_draws


def test_temperature_changes_the_distribution_as_softmax_predicts():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for temperature in (0.5, 1.0, 2.0):
        expected = (row / temperature).softmax(-1)
        observed = _frequencies(row, temperature)
        assert (observed - expected).abs().max() < 0.03, (temperature, observed, expected)
    assert _frequencies(row, 0.5)[0] > _frequencies(row, 2.0)[0] + 0.2


def test_seeded_draws_ignore_the_rest_of_the_batch():
    flat = torch.zeros(1, VOCAB)  # uniform: every draw is decided by the random numbers alone
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [_sample(Sampler(0, CPU), flat, [seeded], step)[0] for step in range(4)]
    for position, batch_size, sampler_seed in ((0, 3, 1), (2, 3, 2), (4, 7, 3)):
        params = [SamplingParams(temperature=1.0, seed=None if i % 2 else 99) for i in range(batch_size)]
        params[position] = seeded
        sampler = Sampler(sampler_seed, CPU)
        logits = _random_logits(batch_size, seed=position)
        logits[position] = 0.0
        in_batch = [_sample(sampler, logits, params, step)[position] for step in range(4)]
        assert in_batch == alone
    assert len(set(alone)) > 1, "the sample index must feed the seed"


def test_different_seeds_draw_differently_and_unseeded_rows_vary():
    flat = torch.zeros(8, VOCAB)
    seeded = _sample(Sampler(0, CPU), flat, [SamplingParams(seed=s) for s in range(8)])
    assert len(set(seeded)) > 4
    sampler = Sampler(0, CPU)
    first = _sample(sampler, flat, [SamplingParams()] * 8)
    second = _sample(sampler, flat, [SamplingParams()] * 8)
    assert first != second


# Boundaries, with exact float cases: each filter's documented comparison, not just far-off probabilities.


def test_top_p_exactly_at_a_cumulative_boundary_keeps_the_head_that_reaches_it():
    uniform = torch.zeros(1, 4)  # probabilities 0.25 each: cumulative mass 0.25, 0.5, 0.75, 1.0, exact in fp32
    for top_p, num_kept in ((0.25, 1), (0.5, 2), (0.75, 3), (0.7500001, 4), (0.2499999, 1)):
        probs = _filtered(uniform, [SamplingParams(top_p=top_p)])
        assert int(probs.gt(0).sum()) == num_kept, top_p
        torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_min_p_keeps_a_token_exactly_at_the_threshold():
    for min_p in (0.5, 0.25, 0.125):
        logits = torch.tensor([[0.0, math.log(min_p), math.log(min_p) - 0.01]])
        probs = logits.softmax(-1)
        assert probs[0, 1] == min_p * probs[0, 0] * 1.0  # the precondition: exactly at the threshold in fp32
        kept = _filtered(logits, [SamplingParams(min_p=min_p)]).gt(0).tolist()
        assert kept == [[True, True, False]], min_p


def test_top_k_keeps_exactly_k_even_among_ties():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    for k, num_kept in ((1, 1), (2, 2), (4, 4), (5, 5), (6, 5)):
        assert int(_filtered(logits, [SamplingParams(top_k=k)]).gt(0).sum()) == num_kept, k


def test_disabled_filters_keep_every_token():
    logits = _random_logits(2, seed=7)
    for params in (SamplingParams(top_k=-1), SamplingParams(top_k=0), SamplingParams(top_k=VOCAB),
                   SamplingParams(top_p=1.0), SamplingParams(min_p=0.0)):
        probs = _filtered(logits, [params, SamplingParams(top_k=3)])
        assert bool(probs[0].gt(0).all()), params
        torch.testing.assert_close(probs[0], logits[0].softmax(-1))


def test_temperatures_below_the_minimum_are_greedy_and_the_minimum_samples():
    flat = torch.zeros(1, VOCAB)
    flat[0, 17] = 1e-6  # the argmax, by a margin sampling at temperature 1e-5 would ignore
    draws = {_sample(Sampler(seed, CPU), flat, [SamplingParams(temperature=MIN_TEMPERATURE)])[0] for seed in range(6)}
    assert draws != {17}
    for temperature in (0.0, MIN_TEMPERATURE * 0.99):
        assert SamplingParams(temperature=temperature).is_greedy
        assert _sample(Sampler(0, CPU), flat, [SamplingParams(temperature=temperature)]) == [17]
    assert not SamplingParams(temperature=MIN_TEMPERATURE).is_greedy


def test_samplers_with_the_same_seed_draw_the_same_unseeded_tokens():
    flat = torch.zeros(6, VOCAB)
    torch.manual_seed(1)  # the global generator must play no part
    first = _sample(Sampler(3, CPU), flat, [SamplingParams()] * 6)
    torch.manual_seed(2)
    assert _sample(Sampler(3, CPU), flat, [SamplingParams()] * 6) == first
    assert _sample(Sampler(4, CPU), flat, [SamplingParams()] * 6) != first


def test_min_p_threshold_is_per_row():
    logits = torch.tensor([[0.0, 0.0, 0.0, -9.0], [5.0, 0.0, 0.0, 0.0]])  # row maxima ~0.33 and ~0.98
    probs = _filtered(logits, [SamplingParams(min_p=0.5), SamplingParams(min_p=0.001)])
    assert probs.gt(0).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_a_row_without_top_p_keeps_its_negligible_tail_when_another_row_uses_it():
    logits = torch.tensor([[0.0, -30.0, -30.0, -30.0], [0.0, 0.0, 0.0, 0.0]])  # row 0's tail sums to ~1e-13
    probs = _filtered(logits, [SamplingParams(), SamplingParams(top_p=0.5)])
    assert probs[0].gt(0).all() and int(probs[1].gt(0).sum()) == 2

"""Top-p among each row's most likely tokens (sampler._mask_among_candidates) on a realistic vocabulary: the
same survivors and logits as sorting the whole vocabulary, which rows fall back to that sort, and a row's
result alone equal to its result beside rows that fall back."""

import pytest
import torch

from services.engine.core.sampling_params import SamplingParams
from services.engine.runner import sampler as sampler_module
from services.engine.runner.sampler import TOP_P_CANDIDATES, _mask_by_full_sort, _mask_top_k_top_p
from services.engine.runner.sampling_batch import make_sampling_batch
from tests.runner.helpers import make_seq

VOCAB = 8 * TOP_P_CANDIDATES
CPU = torch.device("cpu")

# (temperature, SamplingParams): peaked rows whose top-p head fits among the candidates, rows whose top-k does,
# and flat rows (high temperature, top_p 0.99) that need more tokens than that
PEAKED = [(0.2, SamplingParams(temperature=0.2, top_p=0.9)), (0.7, SamplingParams(temperature=0.7, top_p=0.95)),
          (1.0, SamplingParams(top_p=0.5)), (1.0, SamplingParams(top_k=40, top_p=0.9)),
          (1.0, SamplingParams(top_k=TOP_P_CANDIDATES, top_p=0.999)), (1.0, SamplingParams(top_k=20))]
FLAT = [(3.0, SamplingParams(temperature=3.0, top_p=0.99)), (1.0, SamplingParams(top_k=3 * TOP_P_CANDIDATES,
                                                                                  top_p=0.9))]
UNFILTERED = [(1.0, SamplingParams())]


def _batch(rows):
    seqs = [make_seq(i, [1, 2, 3], [0], sampling=params, num_prompt_tokens=3) for i, (_, params) in enumerate(rows)]
    return make_sampling_batch(seqs, VOCAB, CPU)


def _logits(rows, seed: int) -> torch.Tensor:
    """Logits shaped like a language model's (a few strong tokens over a long tail), divided by temperature."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB, generator=generator) * 2.5
    logits[:, :8] += 6.0 * torch.rand(len(rows), 8, generator=generator)
    return logits / torch.tensor([temperature for temperature, _ in rows])[:, None]


def _reference(logits: torch.Tensor, batch) -> torch.Tensor:
    return _mask_by_full_sort(logits, batch.top_ks, batch.top_ps)


@pytest.fixture
def full_sort_rows(monkeypatch) -> list[int]:
    """How many rows each call sorts in full (appended per call)."""
    counts: list[int] = []

    def counting(logits, top_ks, top_ps):
        counts.append(logits.shape[0])
        return _mask_by_full_sort(logits, top_ks, top_ps)

    monkeypatch.setattr(sampler_module, "_mask_by_full_sort", counting)
    return counts


@pytest.mark.parametrize("seed", range(4))
def test_the_candidates_give_the_full_sorts_survivors_and_sort_only_the_rows_they_cannot_hold(seed, full_sort_rows):
    rows = PEAKED + FLAT + UNFILTERED
    batch = _batch(rows)
    logits = _logits(rows, seed)
    expected = _reference(logits, batch)
    masked = _mask_top_k_top_p(logits, batch)
    assert torch.equal(masked.isfinite(), expected.isfinite())
    torch.testing.assert_close(masked[masked.isfinite()], expected[expected.isfinite()], rtol=0, atol=0)
    assert full_sort_rows == [len(FLAT)], "only the flat rows (and the one with top_k above the candidates) sort"
    survivors = expected.isfinite().sum(dim=-1)
    assert (survivors[:len(PEAKED)] <= TOP_P_CANDIDATES).all() and (survivors[len(PEAKED):-1] > 40).all()


def test_a_batch_of_peaked_rows_sorts_nothing(full_sort_rows):
    batch = _batch(PEAKED)
    assert torch.equal(_mask_top_k_top_p(_logits(PEAKED, 9), batch).isfinite(),
                       _reference(_logits(PEAKED, 9), batch).isfinite())
    assert full_sort_rows == []


def test_a_rows_result_alone_equals_its_result_beside_rows_that_fall_back():
    rows = PEAKED + FLAT
    logits = _logits(rows, 11)
    together = _mask_top_k_top_p(logits, _batch(rows))
    for i in range(len(rows)):
        alone = _mask_top_k_top_p(logits[i:i + 1], _batch(rows[i:i + 1]))
        assert torch.equal(alone[0], together[i]), i

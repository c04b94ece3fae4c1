"""min_tokens: EOS and stop token ids are banned for exactly the first min_tokens samples, nothing else is."""

import pytest
import torch

from services.engine.core.sampling_params import SamplingParams
from services.engine.runner.min_tokens import banned_stop_tokens, suppress_stop_tokens_below_min
from services.engine.runner.sampler import Sampler
from services.engine.runner.sampling_batch import make_sampling_batch
from tests.runner.helpers import make_seq

CPU = torch.device("cpu")
VOCAB = 16
EOS_IDS = [2, 3]
PROMPT = [5, 6, 7]


def seq_at(sample_index: int, row: int = 0, **sampling):
    """A sequence about to draw its sample number `sample_index` (that many completion tokens so far)."""
    params = SamplingParams(temperature=0.0, max_tokens=10, **sampling)
    return make_seq(row, PROMPT + [9] * sample_index, [0], sampling=params, num_prompt_tokens=len(PROMPT))


@pytest.mark.parametrize("sample_index, banned", [(0, True), (1, True), (2, False), (3, False)])
def test_bans_last_exactly_min_tokens_samples(sample_index, banned):
    rows, token_ids = banned_stop_tokens([seq_at(sample_index, min_tokens=2, stop_token_ids=[11])], EOS_IDS)
    assert (rows, token_ids) == (([0, 0, 0], [11, 2, 3]) if banned else ([], []))


def test_ignore_eos_bans_only_the_stop_token_ids():
    assert banned_stop_tokens([seq_at(0, min_tokens=1, ignore_eos=True, stop_token_ids=[11, 12])], EOS_IDS) == \
        ([0, 0], [11, 12])
    assert banned_stop_tokens([seq_at(0, min_tokens=1, ignore_eos=True)], EOS_IDS) == ([], [])


def test_each_row_gets_its_own_ban():
    seqs = [seq_at(0, row=0, min_tokens=1), seq_at(0, row=1), seq_at(4, row=2, min_tokens=5, stop_token_ids=[8])]
    assert banned_stop_tokens(seqs, EOS_IDS) == ([0, 0, 2, 2, 2], [2, 3, 8, 2, 3])


def test_suppression_sets_exactly_the_banned_logits_to_minus_inf():
    seqs = [seq_at(0, row=0, min_tokens=1, stop_token_ids=[11]), seq_at(1, row=1, min_tokens=1)]
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    suppress_stop_tokens_below_min(logits, seqs, EOS_IDS)
    expected = original.clone()
    expected[0, [11, 2, 3]] = float("-inf")
    assert torch.equal(logits, expected)


def test_greedy_picks_the_next_best_until_min_tokens_then_eos():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 11], logits[0, 4] = 9.0, 8.0, 7.0  # EOS, then a stop id, then an ordinary token
    picks = []
    for sample_index in range(4):
        seqs = [seq_at(sample_index, min_tokens=2, stop_token_ids=[11])]
        step_logits = logits.clone()
        suppress_stop_tokens_below_min(step_logits, seqs, EOS_IDS)
        picks.append(Sampler(0, CPU)(step_logits, make_sampling_batch(seqs, VOCAB, CPU))[0])
    assert picks == [4, 4, 3, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host syncs only exist with a device")
def test_suppression_and_sampling_never_wait_on_the_device():
    device = torch.device("cuda")
    seqs = [seq_at(0, row=row, min_tokens=3, stop_token_ids=[11], temperature=0.7 * row, top_p=0.9,
                   seed=row if row % 2 else None) for row in range(4)]
    logits = torch.randn(4, VOCAB, device=device)
    sampler = Sampler(0, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        suppress_stop_tokens_below_min(logits, seqs, EOS_IDS)
        token_ids = sampler.sample(logits, make_sampling_batch(seqs, VOCAB, device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not set(token_ids.tolist()) & {2, 3, 11}

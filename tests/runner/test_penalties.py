"""Penalties in the batched sampler against their references: transformers' RepetitionPenaltyLogitsProcessor and a
plain-Python OpenAI presence/frequency formula, over several steps, with unpenalized rows untouched."""

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import SequenceStatus
from services.engine.runner.penalties import PenaltyState
from services.engine.runner.sampling_step import StepSampler
from tests.runner.helpers import make_seq

CPU = torch.device("cpu")
VOCAB = 64


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _seq(seq_id: int, prompt: list[int], output: list[int], sampling: SamplingParams):
    return make_seq(seq_id, prompt + output, [0], sampling=sampling, num_prompt_tokens=len(prompt))


def _openai(logits: list[float], output: list[int], presence: float, frequency: float) -> list[float]:
    """OpenAI's documented formula, one token at a time."""
    result = list(logits)
    for token in set(output):
        count = output.count(token)
        result[token] -= count * frequency + (1.0 if count > 0 else 0.0) * presence
    return result


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    sampling = SamplingParams(temperature=0.0, repetition_penalty=1.7)
    seqs = [_seq(0, [3, 5, 5, 9], [11, 3], sampling), _seq(1, [40, 41], [], sampling)]
    state = PenaltyState(VOCAB, CPU)
    logits = _logits(2, seed=1)
    expected = torch.cat([RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seq.token_ids]), logits[i:i + 1].clone())
                          for i, seq in enumerate(seqs)])
    state.apply(logits, state.prepare(seqs))
    torch.testing.assert_close(logits, expected)


def test_presence_and_frequency_follow_openai_over_output_tokens_only():
    sampling = SamplingParams(temperature=0.0, presence_penalty=0.75, frequency_penalty=-0.5)
    prompt, output = [7, 7, 8], [8, 9, 9, 9, 20]
    seqs = [_seq(0, prompt, output, sampling)]
    state = PenaltyState(VOCAB, CPU)
    logits = _logits(1, seed=2)
    expected = _openai(logits[0].tolist(), output, 0.75, -0.5)
    state.apply(logits, state.prepare(seqs))
    torch.testing.assert_close(logits[0], torch.tensor(expected))
    assert logits[0, 7].item() == expected[7]  # a prompt-only token is not penalized


def test_counts_follow_the_sampled_tokens_step_after_step():
    """Greedy with penalties over 6 steps, the sampler's own scatter updates against recomputing from scratch."""
    sampling = [SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.0, frequency_penalty=1.1)]
    seqs = [_seq(i, [1 + i, 2, 3], [], p) for i, p in enumerate(sampling)]
    sampler = StepSampler(0, VOCAB, CPU)
    base = _logits(1, seed=3)[0]
    for step in range(6):
        logits = base.repeat(3, 1) + 0.01 * step  # the same logits every row: only penalties tell them apart
        ids, _ = sampler.sample(logits.clone(), seqs, eos_token_ids=[])
        for row, seq in enumerate(seqs):
            reference = base + 0.01 * step
            p = seq.sampling
            if p.repetition_penalty != 1.0:
                reference = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
                    torch.tensor([seq.token_ids]), reference[None].clone())[0]
            reference = torch.tensor(_openai(reference.tolist(), seq.completion_token_ids, p.presence_penalty,
                                             p.frequency_penalty))
            assert ids[row].item() == reference.argmax().item(), (step, row)
            seq.append_token(ids[row].item())
    assert len(set(seqs[0].completion_token_ids)) > 1  # the penalties changed the picks
    assert len(set(seqs[1].completion_token_ids)) == 1  # the unpenalized row repeats its argmax


def test_rows_without_penalties_are_untouched_and_a_plain_batch_builds_nothing():
    state = PenaltyState(VOCAB, CPU)
    plain = _seq(0, [1, 2], [3], SamplingParams(temperature=0.0))
    assert state.prepare([plain]) is None and state.output_counts.shape[0] == 0
    penalized = _seq(1, [1, 2], [3], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    logits = _logits(2, seed=4)
    before = logits.clone()
    state.apply(logits, state.prepare([plain, penalized]))
    torch.testing.assert_close(logits[0], before[0], rtol=0, atol=0)
    assert not torch.equal(logits[1], before[1])


def test_a_finished_sequence_frees_its_slot_for_the_next():
    state = PenaltyState(VOCAB, CPU)
    sampling = SamplingParams(temperature=0.0, presence_penalty=1.0)
    first = _seq(0, [1], [5], sampling)
    first_slots = state.prepare([first]).slots.tolist()
    first.status = SequenceStatus.FINISHED
    second = _seq(1, [2], [], sampling)
    batch = state.prepare([second])
    assert state.num_owned_slots == 1 and batch.slots.tolist() == first_slots
    logits = torch.zeros(1, VOCAB)
    state.apply(logits, batch)
    assert logits[0, 5].item() == 0.0  # the reused slot holds no trace of the first sequence's output

"""GrammarMasks without a model: a step with no constrained row touches nothing, a row whose matcher has
rejected a token (which masked sampling never produces) is held to the stop tokens so it ends, not the engine,
and the step sampler applies the mask after the raw log-probabilities and the penalties."""

import torch

from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import Sequence
from services.engine.runner.grammar import GrammarMasks, _RowMatcher
from services.engine.runner.grammar_compiler import GrammarCompiler
from services.engine.runner.sampling_step import StepSampler

VOCAB_SIZE = 100
STOP_TOKEN_IDS = [31, 63]  # bit 31 of its word: the int32 sign bit


def make_seq(seq_id: int, **sampling) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=[1, 2, 3], sampling=SamplingParams(**sampling))


def test_a_step_without_constrained_rows_touches_nothing():
    masks = GrammarMasks(GrammarCompiler(None, VOCAB_SIZE, STOP_TOKEN_IDS), torch.device("cpu"))
    masks.apply(None, [make_seq(0), make_seq(1)])  # None: any use of the logits would raise


def test_a_broken_row_allows_only_the_stop_tokens_and_other_rows_keep_theirs():
    masks = GrammarMasks(GrammarCompiler(None, VOCAB_SIZE, STOP_TOKEN_IDS), torch.device("cpu"))
    free, broken = make_seq(0), make_seq(1, regex="[a-z]+")
    masks._matchers[broken] = _RowMatcher(matcher=None, num_accepted=0, broken=True)
    logits = torch.zeros(2, VOCAB_SIZE)  # [B, V]
    masks.apply(logits, [free, broken])
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == STOP_TOKEN_IDS


def test_the_step_sampler_masks_last_and_reports_raw_logprobs():
    """In StepSampler the mask follows the penalties and comes after the raw log-probabilities are taken."""
    masks = GrammarMasks(GrammarCompiler(None, VOCAB_SIZE, STOP_TOKEN_IDS), torch.device("cpu"))
    seq = make_seq(0, regex="[a-z]+", temperature=0.0, num_logprobs=2, repetition_penalty=0.5)
    masks._matchers[seq] = _RowMatcher(matcher=None, num_accepted=0, broken=True)
    logits = torch.randn(1, VOCAB_SIZE, generator=torch.Generator().manual_seed(0))  # [B, V]
    logits[0, 2] = 10.0  # a prompt token, the raw favourite, boosted further by the penalty
    ids, device_logprobs = StepSampler(0, VOCAB_SIZE, torch.device("cpu")).sample(
        logits.clone(), [seq], eos_token_ids=[], grammar=masks)
    assert ids.tolist()[0] in STOP_TOKEN_IDS
    got = device_logprobs.to_host()[0]
    assert got.logprob == logits.log_softmax(-1)[0, ids[0]].item()
    assert got.top_token_ids[0] == 2

"""Log-probabilities in the batched sampler: torch's log_softmax of the raw logits, whatever temperature,
filters or penalties the row samples with; only the rows that asked, each cut to its own number of alternatives."""

import torch

from services.engine.core.sampling_params import SamplingParams
from services.engine.runner.sampling_step import StepSampler
from tests.runner.helpers import make_seq

CPU = torch.device("cpu")
VOCAB = 100


def _seqs(params: list[SamplingParams]):
    return [make_seq(i, [1, 2, 3, 4], [0], sampling=p, num_prompt_tokens=3) for i, p in enumerate(params)]


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def _sample(params: list[SamplingParams], logits: torch.Tensor):
    ids, device_logprobs = StepSampler(0, VOCAB, CPU).sample(logits.clone(), _seqs(params), eos_token_ids=[2])
    return ids.tolist(), (device_logprobs.to_host() if device_logprobs is not None else None)


def test_sampled_and_top_logprobs_are_the_raw_log_softmax():
    params = [SamplingParams(temperature=0.0, num_logprobs=5),
              SamplingParams(temperature=0.7, top_k=3, top_p=0.8, seed=4, num_logprobs=2, repetition_penalty=1.5),
              SamplingParams(temperature=1.3, min_p=0.2, num_logprobs=0, min_tokens=3)]
    logits = _logits(3)
    ids, logprobs = _sample(params, logits)
    reference = logits.log_softmax(-1)
    for row, p in enumerate(params):
        got = logprobs[row]
        assert got.logprob == reference[row, ids[row]].item()
        values, indices = reference[row].topk(p.num_logprobs)
        assert got.top_token_ids == indices.tolist()
        torch.testing.assert_close(torch.tensor(got.top_logprobs), values, rtol=0, atol=1e-6)
    assert logprobs[0].top_token_ids[0] == ids[0]  # greedy samples the most likely token


def test_only_rows_that_asked_get_logprobs():
    logits = _logits(3, seed=1)
    ids, logprobs = _sample([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, num_logprobs=20),
                             SamplingParams(temperature=0.0)], logits)
    assert set(logprobs) == {1}
    assert len(logprobs[1].top_token_ids) == 20
    assert _sample([SamplingParams(temperature=0.0)] * 2, logits[:2])[1] is None


def test_logprobs_leave_the_sampled_ids_unchanged():
    logits = _logits(4, seed=2)
    plain = [SamplingParams(temperature=0.9, seed=i) for i in range(4)]
    asking = [SamplingParams(temperature=0.9, seed=i, num_logprobs=3) for i in range(4)]
    assert _sample(plain, logits)[0] == _sample(asking, logits)[0]

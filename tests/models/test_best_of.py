"""best_of offline on a tiny random Llama: the n returned completions are the top n by cumulative logprob among
what best_of separate seeded n=1 requests (seed s + i) give, ranked best first."""

import pytest

from services.engine import LLM, SamplingParams
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint

BLOCK_SIZE = 16
PROMPT = list(range(5, 5 + BLOCK_SIZE + 3))
MAX_TOKENS = 6
SEED = 77


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-best-of")
    kind, overrides = CASES["llama"]
    build_checkpoint(kind, overrides, directory)
    return LLM(str(directory), num_kvcache_blocks=64, kvcache_block_size=BLOCK_SIZE)


def _sampling(**overrides) -> SamplingParams:
    return SamplingParams(**({"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True} | overrides))


def _reference(llm: LLM, best_of: int, n: int) -> list[dict]:
    """The top n of best_of separate n=1 requests with seeds SEED + i, by cumulative logprob (ties: lower i)."""
    separate = llm.generate([PROMPT] * best_of, [_sampling(seed=SEED + i, num_logprobs=0) for i in range(best_of)],
                            use_tqdm=False)
    scores = [sum(p.logprob for p in result["logprobs"]) for result in separate]
    assert len(set(scores)) == best_of  # distinct completions: the ranking is not decided by ties
    order = sorted(range(best_of), key=lambda i: (-scores[i], i))
    return [separate[i] for i in order[:n]]


def test_best_of_returns_the_top_n_by_cumulative_logprob_of_separate_seeded_requests(tiny):
    llm = tiny.with_scheduler(enable_prefix_caching=True)
    result = llm.generate([PROMPT], _sampling(seed=SEED, n=2, best_of=4), use_tqdm=False)[0]
    expected = _reference(llm, best_of=4, n=2)
    assert [o["token_ids"] for o in result["outputs"]] == [e["token_ids"] for e in expected]
    assert [o["logprobs"] for o in result["outputs"]] == [None, None]  # the request asked for none
    assert llm.stats()["num_used_blocks"] == 0


def test_best_of_with_n_1_returns_the_single_best_with_the_logprobs_asked_for(tiny):
    llm = tiny.with_scheduler(enable_prefix_caching=True)
    result = llm.generate([PROMPT], _sampling(seed=SEED, n=1, best_of=3, num_logprobs=1), use_tqdm=False)[0]
    [expected] = _reference(llm, best_of=3, n=1)
    assert result["token_ids"] == expected["token_ids"]
    assert [p.logprob for p in result["logprobs"]] == pytest.approx([p.logprob for p in expected["logprobs"]],
                                                                    abs=1e-4)
    assert all(len(p.top_token_ids) == 1 for p in result["logprobs"])


def test_best_of_still_returns_the_prompt_logprobs_once(tiny):
    llm = tiny.with_scheduler(enable_prefix_caching=True)
    result = llm.generate([PROMPT], _sampling(seed=SEED, n=2, best_of=3, num_prompt_logprobs=1), use_tqdm=False)[0]
    [single] = llm.generate([PROMPT], _sampling(seed=SEED, num_prompt_logprobs=1), use_tqdm=False)
    assert len(result["prompt_logprobs"]) == len(PROMPT)
    assert [p.logprob for p in result["prompt_logprobs"][1:]] == pytest.approx(
        [p.logprob for p in single["prompt_logprobs"][1:]], abs=1e-4)
    assert result["outputs"][1]["prompt_logprobs"] is None

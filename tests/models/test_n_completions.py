"""sampling.n offline on a tiny random Llama: n completions share the prompt's KV blocks (prefilled once), each
draws from its own seed stream (seed + index), and aborting the request ends every completion."""

import pytest

from services.common.errors import InvalidRequestError
from services.engine import LLM, SamplingParams
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint

BLOCK_SIZE = 16
PROMPT = list(range(5, 5 + 2 * BLOCK_SIZE + 5))  # 2 full blocks + a partial one
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-n")
    kind, overrides = CASES["llama"]
    build_checkpoint(kind, overrides, directory)
    return LLM(str(directory), num_kvcache_blocks=64, kvcache_block_size=BLOCK_SIZE)


def _fresh(llm: LLM) -> LLM:
    return llm.with_scheduler(enable_prefix_caching=True)  # an empty prefix cache, so counters start at 0


def test_greedy_n4_gives_four_copies_of_n1(tiny):
    llm = _fresh(tiny)
    single = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0]
    multi = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=4),
                         use_tqdm=False)[0]
    assert [o["token_ids"] for o in multi["outputs"]] == [single["token_ids"]] * 4
    assert [o["finish_reason"] for o in multi["outputs"]] == ["length"] * 4


def test_n_prefills_the_prompt_once_and_siblings_hit_the_cache(tiny):
    llm = _fresh(tiny)
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=4),
                 use_tqdm=False)
    stats = llm.stats()
    full = (len(PROMPT) // BLOCK_SIZE) * BLOCK_SIZE
    # completion 0 computes the whole prompt; each sibling recomputes only the partial last block
    assert stats["num_cached_prompt_tokens"] == 3 * full
    assert stats["num_computed_prompt_tokens"] == len(PROMPT) + 3 * (len(PROMPT) - full)
    assert stats["num_used_blocks"] == 0


def test_seeded_n4_equals_four_requests_with_seeds_s_plus_index(tiny):
    llm = _fresh(tiny)
    seed = 1234
    multi = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True, n=4), use_tqdm=False)[0]
    separate = llm.generate([PROMPT] * 4, [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=MAX_TOKENS,
                                                          ignore_eos=True) for i in range(4)], use_tqdm=False)
    assert [o["token_ids"] for o in multi["outputs"]] == [o["token_ids"] for o in separate]
    assert len({tuple(o["token_ids"]) for o in separate}) > 1  # the seeds really differ


def test_abort_ends_every_completion_and_frees_all_blocks(tiny):
    llm = _fresh(tiny)
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, n=4))
    outputs = []
    while not any(o.index == 3 for o in outputs):  # every completion is running
        outputs += engine.step()
    assert engine.stats().num_used_blocks > 0
    assert engine.abort_request("r")
    final = engine.step()
    assert sorted(o.index for o in final if o.finished) == [0, 1, 2, 3]
    assert [o.request_finished for o in final] == [False, False, False, True]
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_used_blocks == 0


def test_abort_before_siblings_are_admitted(tiny):
    engine = _fresh(tiny).engine
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=50, n=3))
    engine.abort_request("r")
    final = engine.step()
    assert sorted(o.index for o in final) == [0, 1, 2] and final[-1].request_finished
    assert not engine.has_unfinished_requests() and engine.stats().num_used_blocks == 0


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused(n):
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(n=n)
    assert excinfo.value.field == "sampling.n"
    assert str(n) in str(excinfo.value)


def test_n_bounds_inclusive():
    SamplingParams(n=1)
    SamplingParams(n=16)

"""Prompt logprobs through the offline engine on a tiny random Llama, against transformers' log_softmax of its
logits at every prompt position (fp32 on the CPU): unchunked, chunked small, behind a warm prefix cache, and
across a preemption."""

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.core.errors import InvalidRequestError
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint

BLOCK_SIZE = 16
PROMPTS = [list(range(5, 45)), [40, 41, 40, 41, 40, 41, 40], [300]]  # 40 tokens (2.5 blocks), 7, 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-prompt-logprobs")
    kind, overrides = CASES["llama"]
    hf_model = build_checkpoint(kind, overrides, directory)
    return LLM(str(directory), num_kvcache_blocks=64, kvcache_block_size=BLOCK_SIZE, dtype="float32"), hf_model


def _reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """log_softmax [T - 1, V] of the positions that predict prompt tokens 1 .. T - 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def _params(num_prompt_logprobs: int | None, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          num_prompt_logprobs=num_prompt_logprobs)


def _assert_match(hf_model, prompt: list[int], entries: list, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    reference = _reference(hf_model, prompt)
    for position, entry in enumerate(entries[1:]):
        values, ids = reference[position].topk(k)
        assert entry.top_token_ids == ids.tolist(), f"position {position + 1}"
        torch.testing.assert_close(torch.tensor(entry.top_logprobs), values, rtol=0, atol=1e-4)
        assert entry.logprob == pytest.approx(reference[position, prompt[position + 1]].item(), abs=1e-4)


def test_prompt_logprobs_equal_transformers_at_every_position(tiny):
    llm, hf_model = tiny
    params = [_params(5), _params(None), _params(0), _params(20)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    alone = llm.generate([PROMPTS[0]], _params(None), use_tqdm=False)[0]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, param, output in zip(prompts, params, outputs):
        if param.num_prompt_logprobs is not None:
            _assert_match(hf_model, prompt, output["prompt_logprobs"], param.num_prompt_logprobs)
    assert outputs[1]["prompt_logprobs"] is None  # its batch mate asked; it did not
    assert outputs[1]["token_ids"] == alone["token_ids"] == outputs[0]["token_ids"]
    assert outputs[3]["prompt_logprobs"] == [None]  # one token: nothing predicts it


@pytest.mark.parametrize("budget", [8, 16, 13])
def test_chunked_prefill_gives_the_unchunked_entries(tiny, budget):
    llm, hf_model = tiny
    [unchunked] = llm.generate([PROMPTS[0]], _params(4), use_tqdm=False)
    # max_num_seqs 2: the lm_head also runs over the prompt rows in slices of 2
    chunked_llm = llm.with_scheduler(max_num_batched_tokens=budget, max_num_seqs=2)
    [chunked] = chunked_llm.generate([PROMPTS[0]], _params(4), use_tqdm=False)
    assert chunked_llm.stats()["num_computed_prompt_tokens"] == len(PROMPTS[0])  # in ceil(40 / budget) steps
    _assert_match(hf_model, PROMPTS[0], chunked["prompt_logprobs"], 4)
    for got, expected in zip(chunked["prompt_logprobs"][1:], unchunked["prompt_logprobs"][1:]):
        assert got.top_token_ids == expected.top_token_ids
        assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)


def test_a_warm_prefix_cache_still_gives_every_entry(tiny):
    llm, hf_model = tiny
    warm = llm.with_scheduler(num_kvcache_blocks=16)
    [first] = warm.generate([PROMPTS[0]], _params(None), use_tqdm=False)
    [asking] = warm.generate([PROMPTS[0]], _params(2), use_tqdm=False)
    [again] = warm.generate([PROMPTS[0]], _params(None), use_tqdm=False)
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] == 2 * BLOCK_SIZE  # the cache was warm
    assert asking["num_cached_tokens"] == 0  # ... and the asking request computed its whole prompt
    _assert_match(hf_model, PROMPTS[0], asking["prompt_logprobs"], 2)
    assert asking["token_ids"] == first["token_ids"]


def test_a_preempted_request_sends_its_prompt_logprobs_once(tiny):
    llm, hf_model = tiny
    # 6 blocks: two 40-token prompts take 3 each; the first decode step that needs a fourth block preempts one
    small = llm.with_scheduler(num_kvcache_blocks=6, enable_prefix_caching=False)
    for index in range(2):
        small.engine.add_request(f"r{index}", PROMPTS[0], _params(3, max_tokens=2 * BLOCK_SIZE))
    sent: dict[str, list] = {"r0": [], "r1": []}
    while small.engine.has_unfinished_requests():
        for output in small.engine.step():
            if output.prompt_logprobs is not None:
                sent[output.request_id].append((output.num_completion_tokens, output.prompt_logprobs))
    assert small.stats()["num_preemptions"] >= 1
    for chunks in sent.values():
        [(num_completion_tokens, prompt_logprobs)] = chunks
        assert num_completion_tokens == 1
        _assert_match(hf_model, PROMPTS[0], [None, *prompt_logprobs.positions()], 3)


def test_out_of_range_is_invalid_naming_the_field(tiny):
    llm, _ = tiny
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate([PROMPTS[1]], _params(21), use_tqdm=False)
    assert caught.value.field == "sampling.num_prompt_logprobs"


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_n_completions_carry_the_prompts_entries_once_on_completion_0(tiny, enable_prefix_caching):
    llm, hf_model = tiny
    engine = llm.with_scheduler(enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=3, ignore_eos=True, n=3, num_prompt_logprobs=1)
    [result] = engine.generate([PROMPTS[1]], params, use_tqdm=False)
    _assert_match(hf_model, PROMPTS[1], result["prompt_logprobs"], 1)
    assert [c["prompt_logprobs"] is None for c in result["outputs"]] == [False, True, True]

"""The default model (SmolLM2-135M-Instruct GGUF, fp32 on CPU): greedy ids equal transformers' generate,
alone, batched, with prefix caching on and off, chunked prefill, preemption, and text vs token-id prompts."""

import pytest

from services.engine import SamplingParams
from tests.models.conftest import CHAT_MESSAGES, MAX_NEW_TOKENS, TEXT_PROMPTS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def _ids(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def test_prompts_cover_a_long_one_and_the_references_are_not_trivial(default_prompt_ids, hf_references):
    assert len(default_prompt_ids) >= 9
    assert max(len(p) for p in default_prompt_ids) > 150
    assert all(len(r) >= 8 for r in hf_references)
    assert sum(len(r) == MAX_NEW_TOKENS for r in hf_references) >= 5


def test_each_prompt_alone(default_llm, default_prompt_ids, hf_references):
    for prompt, reference in zip(default_prompt_ids, hf_references):
        assert _ids(default_llm.generate([prompt], GREEDY, use_tqdm=False)) == [reference]


def test_all_prompts_in_one_batch(default_llm, default_prompt_ids, hf_references):
    outputs = default_llm.generate(default_prompt_ids, GREEDY, use_tqdm=False)
    assert _ids(outputs) == hf_references
    for output, reference in zip(outputs, hf_references):
        assert output["finish_reason"] == ("stop" if len(reference) < MAX_NEW_TOKENS else "length")


def test_prefix_caching_off(default_llm, default_prompt_ids, hf_references):
    llm = default_llm.with_scheduler(enable_prefix_caching=False)
    assert _ids(llm.generate(default_prompt_ids, GREEDY, use_tqdm=False)) == hf_references
    assert _ids(llm.generate(default_prompt_ids, GREEDY, use_tqdm=False)) == hf_references
    assert llm.stats()["num_cached_prompt_tokens"] == 0


def test_prefix_cache_hits_on_the_second_pass(default_llm, default_prompt_ids, hf_references):
    llm = default_llm.with_scheduler(enable_prefix_caching=True)
    assert _ids(llm.generate(default_prompt_ids, GREEDY, use_tqdm=False)) == hf_references
    cached_before = llm.stats()["num_cached_prompt_tokens"]
    second = llm.generate(default_prompt_ids, GREEDY, use_tqdm=False)
    assert _ids(second) == hf_references
    assert llm.stats()["num_cached_prompt_tokens"] > cached_before
    longest = max(range(len(default_prompt_ids)), key=lambda i: len(default_prompt_ids[i]))
    assert second[longest]["num_cached_tokens"] >= 16 * ((len(default_prompt_ids[longest]) - 1) // 16)


@pytest.mark.parametrize("max_num_batched_tokens", [13, 37])
def test_chunked_prefill_at_block_misaligned_sizes(default_llm, default_prompt_ids, hf_references,
                                                    max_num_batched_tokens):
    llm = default_llm.with_scheduler(max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)
    assert _ids(llm.generate(default_prompt_ids, GREEDY, use_tqdm=False)) == hf_references
    stats = llm.stats()
    assert stats["num_computed_prompt_tokens"] == sum(len(p) for p in default_prompt_ids)


def test_preemption_under_a_tiny_kv_cache(default_llm, default_prompt_ids, hf_references):
    block_size = 16
    largest = max(-(-(len(p) + MAX_NEW_TOKENS) // block_size) for p in default_prompt_ids)
    llm = default_llm.with_scheduler(num_kvcache_blocks=largest + 4)
    assert _ids(llm.generate(default_prompt_ids, GREEDY, use_tqdm=False)) == hf_references
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == largest + 4


def test_text_prompt_equals_token_id_prompt(default_llm, default_prompt_ids, hf_references):
    as_text = default_llm.generate(TEXT_PROMPTS[0], GREEDY, use_tqdm=False)
    as_ids = default_llm.generate([default_prompt_ids[0]], GREEDY, use_tqdm=False)
    assert _ids(as_text) == _ids(as_ids) == [hf_references[0]]
    assert as_text[0]["text"] == default_llm.tokenizer.decode(hf_references[0], skip_special_tokens=True)


def test_chat_applies_the_template(default_llm, hf_references):
    outputs = default_llm.chat(CHAT_MESSAGES, GREEDY, use_tqdm=False)
    assert _ids(outputs) == [hf_references[-1]]
    assert "<|im_end|>" not in outputs[0]["text"] and outputs[0]["text"].strip()

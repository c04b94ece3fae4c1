"""The offline API's contract on a tiny checkpoint: validation before running, outputs in order, stats."""

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.core.errors import InvalidRequestError
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-api")
    kind, overrides = CASES["llama"]
    hf_model = build_checkpoint(kind, overrides, directory)
    return LLM(str(directory), num_kvcache_blocks=32, max_model_len=128, dtype="float32"), hf_model


def _assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_one_invalid_request_runs_none(tiny_llama):
    llm, _ = tiny_llama
    generated_before = llm.stats()["num_generated_tokens"]
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([[5, 6, 7], [8, 9, 512]], GREEDY, use_tqdm=False)
    assert error.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([[5, 6, 7], [8, 9]], [GREEDY, SamplingParams(max_tokens=127)], use_tqdm=False)
    assert error.value.field == "sampling.max_tokens"
    assert llm.stats()["num_generated_tokens"] == generated_before
    _assert_idle(llm)


def test_sampling_params_list_must_match_prompts(tiny_llama):
    llm, _ = tiny_llama
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([[5, 6], [7, 8]], [GREEDY], use_tqdm=False)
    assert error.value.field == "sampling_params"
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([], GREEDY, use_tqdm=False)
    assert error.value.field == "prompts"


def test_outputs_keep_input_order_with_per_request_params(tiny_llama):
    llm, hf_model = tiny_llama
    prompts = [[10 + i] * (3 + 9 * i) for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (32, 4, 17, 9)]
    outputs = llm.generate(prompts, params, use_tqdm=True)
    for prompt, param, output in zip(prompts, params, outputs):
        reference = hf_greedy(hf_model, prompt)[:param.max_tokens]
        assert output["token_ids"] == reference
        assert output["finish_reason"] == ("length" if len(reference) == param.max_tokens else "stop")
        assert output["text"] == ""  # no tokenizer in this checkpoint
    _assert_idle(llm)


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama):
    llm, _ = tiny_llama
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True)
    alone = llm.generate([[4, 5, 6]], seeded, use_tqdm=False)[0]["token_ids"]
    others = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    batch = llm.generate([[9] * 20, [4, 5, 6], [11] * 7], [others, seeded, others], use_tqdm=False)
    assert batch[1]["token_ids"] == alone
    unseeded = [llm.generate([[4, 5, 6]], others, use_tqdm=False)[0]["token_ids"] for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_stats_report_the_cache(tiny_llama):
    llm, _ = tiny_llama
    before = llm.stats()
    prompt = [40 + i for i in range(21)]  # one full 16-token block, then 5 tokens
    llm.generate([prompt, prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    after = llm.stats()
    assert after["num_total_blocks"] == after["num_free_blocks"] == 32
    assert after["num_running"] == after["num_waiting"] == after["num_used_blocks"] == 0
    assert after["num_generated_tokens"] - before["num_generated_tokens"] == 6
    num_prompt_tokens = (after["num_cached_prompt_tokens"] + after["num_computed_prompt_tokens"]
                         - before["num_cached_prompt_tokens"] - before["num_computed_prompt_tokens"])
    assert num_prompt_tokens == 2 * 21
    assert after["num_preemptions"] == before["num_preemptions"]


def test_text_needs_a_tokenizer(tiny_llama):
    llm, _ = tiny_llama
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("hello", GREEDY, use_tqdm=False)
    assert error.value.field == "prompts" and "tokenizer" in error.value.description
    assert torch.is_inference_mode_enabled() is False


@pytest.mark.slow
def test_min_tokens_keeps_eos_out_until_reached(default_llm):
    """A chat reply that greedily ends early must run to min_tokens without an EOS, then may stop."""
    messages = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    short = default_llm.chat(messages, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert short["finish_reason"] == "stop"
    num_short = len(short["token_ids"])
    min_tokens = num_short + 5
    longer = default_llm.chat(messages, SamplingParams(temperature=0, max_tokens=64, min_tokens=min_tokens),
                              use_tqdm=False)[0]
    ids = longer["token_ids"]
    assert len(ids) > min_tokens
    assert not set(ids[:min_tokens]) & set(default_llm.eos_token_ids)
    assert ids[:num_short - 1] == short["token_ids"][:num_short - 1]

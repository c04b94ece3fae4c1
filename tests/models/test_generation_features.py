"""Logprobs and penalties through the offline engine on a tiny random Llama, against transformers on the CPU:
log_softmax of its logits, generate() with repetition_penalty, and OpenAI's formula applied to its logits."""

import json

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint

MAX_TOKENS = 12
PROMPTS = [[5, 6, 7, 8], [40, 41, 40, 41, 40, 41, 40], [300] * 20]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-features")
    kind, overrides = CASES["llama"]
    hf_model = build_checkpoint(kind, overrides, directory)
    return LLM(str(directory), num_kvcache_blocks=64, kvcache_block_size=16, dtype="float32"), hf_model


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [T, V]


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


def test_logprobs_equal_transformers_log_softmax(tiny):
    llm, hf_model = tiny
    params = [_greedy(num_logprobs=5), _greedy(), _greedy(num_logprobs=20)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outputs[1]["logprobs"] is None
    for prompt, param, output in zip(PROMPTS, params, outputs):
        if param.num_logprobs is None:
            continue
        ids = output["token_ids"]
        reference = _hf_logits(hf_model, prompt + ids[:-1])[len(prompt) - 1:].log_softmax(-1)  # [MAX_TOKENS, V]
        assert len(output["logprobs"]) == len(ids) == MAX_TOKENS
        for position, (token_id, got) in enumerate(zip(ids, output["logprobs"])):
            values, indices = reference[position].topk(param.num_logprobs)
            assert got.top_token_ids == indices.tolist()
            torch.testing.assert_close(torch.tensor(got.top_logprobs), values, rtol=0, atol=1e-4)
            assert got.logprob == pytest.approx(reference[position, token_id].item(), abs=1e-4)


def test_repetition_penalty_equals_transformers_generate(tiny):
    llm, hf_model = tiny
    penalized = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, repetition_penalty=1.8)
    outputs = llm.generate(PROMPTS, penalized, use_tqdm=False)  # min_tokens bans EOS as min_new_tokens does
    plain = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    for prompt, output, unpenalized in zip(PROMPTS, outputs, plain):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            reference = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          repetition_penalty=1.8, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                          pad_token_id=0)[0, len(prompt):].tolist()
        assert output["token_ids"] == reference
    assert any(o["token_ids"] != u["token_ids"] for o, u in zip(outputs, plain))


def test_presence_and_frequency_penalties_equal_openais_formula(tiny):
    llm, hf_model = tiny
    presence, frequency = 0.8, 0.6
    [output] = llm.generate([PROMPTS[0]], _greedy(presence_penalty=presence, frequency_penalty=frequency),
                            use_tqdm=False)
    generated: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = _hf_logits(hf_model, PROMPTS[0] + generated)[-1].tolist()
        for token in set(generated):
            count = generated.count(token)
            logits[token] -= count * frequency + presence
        generated.append(max(range(len(logits)), key=logits.__getitem__))
    assert output["token_ids"] == generated


def test_penalized_and_logprob_rows_leave_their_batch_mates_alone(tiny):
    llm, _ = tiny
    alone = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded_alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0]["token_ids"]
    mixed = llm.generate(PROMPTS + [PROMPTS[0]] * 2,
                         [_greedy(repetition_penalty=1.8, num_logprobs=3), _greedy(),
                          _greedy(frequency_penalty=2.0), _greedy(presence_penalty=-2.0), seeded],
                         use_tqdm=False)
    assert mixed[1]["token_ids"] == alone[1]["token_ids"]
    assert mixed[4]["token_ids"] == seeded_alone


def test_offline_defaults_come_from_the_generation_config_and_requests_win(tmp_path):
    kind, overrides = CASES["llama"]
    build_checkpoint(kind, overrides, tmp_path)
    config_path = tmp_path / "generation_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"temperature": 0.0, "top_k": 7}))
    llm = LLM(str(tmp_path), num_kvcache_blocks=16, dtype="float32")
    defaults = llm.default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 7, 1.0)
    [by_default] = llm.generate([PROMPTS[2]], use_tqdm=False)
    [greedy] = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0), use_tqdm=False)
    assert by_default["token_ids"] == greedy["token_ids"]
    hot = [llm.generate([PROMPTS[2]], SamplingParams(temperature=5.0, seed=seed), use_tqdm=False)[0]["token_ids"]
           for seed in range(3)]
    assert any(ids != greedy["token_ids"] for ids in hot)  # the request's temperature, not the default 0

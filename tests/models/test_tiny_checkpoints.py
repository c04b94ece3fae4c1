"""Tiny random-weight Llama and Qwen3 checkpoints built with transformers: our greedy ids equal HF's."""

import json

import pytest
import torch

from services.engine import LLM, SamplingParams

MAX_NEW_TOKENS = 32
PROMPT_LENS = [5, 23, 40]

CASES = {
    "llama": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "llama-3kv-heads-dim24": ("llama", dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=3,
                                            head_dim=24, tie_word_embeddings=False)),
    "llama3-rope": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 32})),
    "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "qwen3-tied": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
}


def build_checkpoint(kind: str, overrides: dict, directory) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = config_class(**(fields | overrides))
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_checkpoint(kind, overrides, directory)
    generator = torch.Generator().manual_seed(len(request.param))
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    references = [hf_greedy(hf_model, p) for p in prompts]
    llm = LLM(str(directory), num_kvcache_blocks=64, kvcache_block_size=16, dtype="float32")
    return llm, prompts, references


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def test_batch_equals_hugging_face(tiny):
    llm, prompts, references = tiny
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == references


def test_chunked_prefill_equals_hugging_face(tiny):
    llm, prompts, references = tiny
    chunked = llm.with_scheduler(max_num_batched_tokens=13)
    outputs = chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == references


def test_architecture_and_layout_were_read_from_the_checkpoint(tiny):
    llm, _, _ = tiny
    config = llm.runner.model_config
    with open(f"{llm.runner.model_path}/config.json") as f:
        raw = json.load(f)
    assert config.architecture == raw["model_type"]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"])
    assert config.tie_word_embeddings == raw["tie_word_embeddings"]
    assert llm.tokenizer is None and llm.eos_token_ids == [2]


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                      "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path))


def test_unknown_engine_argument_is_a_type_error():
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(max_num_sequences=4)


def test_a_sharing_clone_never_corrupts_the_original_prefix_cache(tiny):
    llm, prompts, references = tiny
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == references
    other_prompts = [[(t * 7) % 509 + 3 for t in p] for p in prompts]
    llm.with_scheduler(max_num_batched_tokens=16).generate(other_prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _ids(again) == references
    assert all(o["num_cached_tokens"] >= 16 for o, p in zip(again, prompts) if len(p) > 16)


def _ids(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]

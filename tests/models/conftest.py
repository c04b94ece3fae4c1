"""Session-scoped fixtures for the model tests: the default model is loaded once per run."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from services.common.default_model import default_model_path as locate

    return locate()


MAX_NEW_TOKENS = 32
TEXT_PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n    ",
    "请用中文介绍一下长城的历史。",
    "I love 🍕 and 🎉 because",
    "Translate to French: The weather is nice today.",
    "1, 1, 2, 3, 5, 8, 13,",
    "Die Hauptstadt von Deutschland ist",
    ("The history of computing is a long story of people trying to make calculation easier. Early tools such as "
     "the abacus let merchants add and subtract quickly. In the seventeenth century, Pascal and Leibniz built "
     "mechanical calculators with gears and wheels. Charles Babbage later designed the Analytical Engine, a "
     "machine with a store and a mill that could, in principle, follow a program punched on cards, and Ada "
     "Lovelace wrote what many call the first program for it. A century later, electronic machines replaced "
     "gears with vacuum tubes, then transistors, then integrated circuits, and each step made computers smaller, "
     "faster and cheaper. Today a phone in your pocket is more powerful than the machines that guided the first "
     "missions to the Moon. To summarize this story in one sentence,"),
]
CHAT_MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="session")
def default_llm(default_model_path):
    """The default model in our engine, loaded once: fp32 whatever the CPU (the equality suite compares it with
    transformers' fp32), 256 KV blocks of 16 tokens."""
    from services.engine import LLM

    return LLM(num_kvcache_blocks=256, kvcache_block_size=16, dtype="float32")


@pytest.fixture(scope="session")
def default_prompt_ids(default_llm) -> list[list[int]]:
    """Token ids of every equivalence prompt: the text prompts, then the chat-templated one."""
    tokenizer = default_llm.tokenizer
    chat_text = tokenizer.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    return [tokenizer.encode(p) for p in TEXT_PROMPTS] + [tokenizer.encode(chat_text, add_special_tokens=False)]


@pytest.fixture(scope="session")
def hf_references(default_model_path, default_prompt_ids) -> list[list[int]]:
    """transformers' greedy completions of every prompt, one prompt at a time, computed once per run."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path),
                                                 gguf_file=os.path.basename(default_model_path),
                                                 dtype=torch.float32).eval()
    references = []
    with torch.no_grad():
        for prompt in default_prompt_ids:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=2)
            references.append(out[0, len(prompt):].tolist())
    del model
    return references

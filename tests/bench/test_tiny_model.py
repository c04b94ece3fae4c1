"""bench/tiny_model.py: a tiny random Llama that both services load from one directory, with the default model's
tokenizer, written once per seed."""

import json
import os

import pytest

from bench.tiny_model import MARKER, TINY_LLAMA, write_tiny_model

pytestmark = pytest.mark.slow  # reads the default GGUF's tokenizer twice (~20 s each on a busy machine)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("bench-tiny"))
    assert write_tiny_model(directory, seed=0)
    return directory


def test_both_services_load_the_default_tokenizer_from_the_directory(tiny_dir):
    from transformers import AutoTokenizer

    from services.common.default_model import default_model_path
    from services.common.fingerprint import tokenizer_fingerprint
    from services.tokenizer.tokenizer import TextTokenizer

    gguf = default_model_path()
    default = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    ours = TextTokenizer.load(tiny_dir)
    assert ours.source.gguf_file is None, "the tokenizer service must read the saved files, not a GGUF"
    assert ours.fingerprint() == tokenizer_fingerprint(default)
    assert ours.vocab_size == TINY_LLAMA["vocab_size"] == 49152
    assert ours.has_chat_template


def test_the_engine_loads_it_and_greedy_outputs_are_not_one_repeated_token(tiny_dir):
    from services.engine import LLM, SamplingParams

    llm = LLM(tiny_dir, num_kvcache_blocks=64)
    assert llm.runner.vocab_size == 49152 and llm.tokenizer is not None
    config = json.load(open(os.path.join(tiny_dir, "config.json")))
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 64, 49152)
    out = llm.generate([[100, 200, 300, 400]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]["token_ids"]
    assert len(out) == 16 and len(set(out)) > 4


def test_writing_again_keeps_the_directory_and_another_seed_rewrites_it(tiny_dir, tmp_path):
    weights = os.path.join(tiny_dir, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns
    assert not write_tiny_model(tiny_dir, seed=0)
    assert os.stat(weights).st_mtime_ns == mtime
    other = str(tmp_path / "other")
    assert write_tiny_model(other, seed=1)
    assert open(os.path.join(other, "model.safetensors"), "rb").read() != open(weights, "rb").read()
    assert json.loads(open(os.path.join(other, MARKER)).read())["seed"] == 1

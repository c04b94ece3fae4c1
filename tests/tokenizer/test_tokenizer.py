"""TextTokenizer: loading, chat templates, validation, fingerprint and generation defaults."""

import pytest

from services.common.generation_defaults import NEUTRAL_SAMPLING
from services.tokenizer.errors import InvalidRequestError, TokenizerLoadError
from services.tokenizer.tokenizer import (
    TextTokenizer,
    default_model_path,
    resolve_model_source,
)
from tests.tokenizer.helpers import build_tiny_tokenizer_dir

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What colour is the sky? 🌤"},
]


def test_default_model_basics(text_tokenizer):
    hf = text_tokenizer.hf_tokenizer
    assert text_tokenizer.name == "SmolLM2-135M-Instruct"
    assert text_tokenizer.vocab_size == len(hf) == 49152
    assert text_tokenizer.eos_token_ids == [hf.eos_token_id] == [2]
    assert text_tokenizer.has_chat_template


def test_encode_decode_round_trip(text_tokenizer):
    text = "Hello world, 你好 😀 สวัสดี"
    ids = text_tokenizer.encode(text)
    assert ids == list(text_tokenizer.hf_tokenizer.encode(text))
    assert text_tokenizer.decode(ids) == text
    assert text_tokenizer.tokens(ids[:1]) == ["Hello"]


def test_decode_keeps_or_skips_special_tokens(text_tokenizer):
    ids = [*text_tokenizer.encode("Hi"), 2]
    assert text_tokenizer.decode(ids, skip_special_tokens=False) == "Hi<|im_end|>"
    assert text_tokenizer.decode(ids, skip_special_tokens=True) == "Hi"


def test_chat_template_equals_transformers(text_tokenizer):
    expected = text_tokenizer.hf_tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = text_tokenizer.apply_chat_template(CONVERSATION)
    assert ids == list(expected)
    assert text_tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_chat_template_without_generation_prompt(text_tokenizer):
    ids = text_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert text_tokenizer.decode(ids, skip_special_tokens=False).endswith("🌤<|im_end|>\n")


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}], "chat.messages[1].role"),
        ([{"content": "no role"}], "chat.messages[0].role"),
        ([{"role": "user", "content": 7}], "chat.messages[0].content"),
        (["just a string"], "chat.messages[0]"),
        ([], "chat.messages"),
    ],
)
def test_chat_messages_are_validated(text_tokenizer, messages, field):
    with pytest.raises(InvalidRequestError) as excinfo:
        text_tokenizer.apply_chat_template(messages)
    assert excinfo.value.field == field


def test_tool_role_is_accepted(text_tokenizer):
    ids = text_tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}])
    assert "<|im_start|>tool\n42<|im_end|>" in text_tokenizer.decode(ids, skip_special_tokens=False)


def test_encode_rejects_non_text(text_tokenizer):
    with pytest.raises(InvalidRequestError) as excinfo:
        text_tokenizer.encode(b"bytes")
    assert excinfo.value.field == "text"


def test_gguf_path_and_default_resolve_alike():
    explicit = resolve_model_source(default_model_path())
    assert explicit == resolve_model_source(None)
    assert explicit.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_model_path_fails_to_load(tmp_path):
    with pytest.raises(TokenizerLoadError):
        TextTokenizer.load(str(tmp_path / "nothing-here"))
    with pytest.raises(TokenizerLoadError):
        TextTokenizer.load(str(tmp_path))


def test_fingerprint_is_stable_across_loads(text_tokenizer):
    again = TextTokenizer.load(None)
    assert again.fingerprint() == text_tokenizer.fingerprint()
    assert len(text_tokenizer.fingerprint()) == 16


def test_fingerprint_differs_for_a_different_tokenizer(text_tokenizer, tmp_path):
    first = TextTokenizer.load(build_tiny_tokenizer_dir(tmp_path / "a", ["hello", "world"]))
    second = TextTokenizer.load(build_tiny_tokenizer_dir(tmp_path / "b", ["hello", "world"]))
    other = TextTokenizer.load(build_tiny_tokenizer_dir(tmp_path / "c", ["hello", "there"]))
    assert first.fingerprint() == second.fingerprint()
    assert first.fingerprint() != other.fingerprint()
    assert first.fingerprint() != text_tokenizer.fingerprint()


def test_directory_without_chat_template_rejects_chat(tmp_path):
    tok = TextTokenizer.load(build_tiny_tokenizer_dir(tmp_path, ["hello", "world"]))
    assert tok.name == tmp_path.name
    assert tok.encode("hello world", add_special_tokens=False) == [2, 3]
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError) as excinfo:
        tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert excinfo.value.field == "chat"


def test_the_embedded_gguf_takes_its_model_cards_defaults(text_tokenizer):
    assert text_tokenizer.name == "SmolLM2-135M-Instruct"
    assert text_tokenizer.generation_defaults() == {
        "temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def test_another_model_without_a_generation_config_gets_neutral_defaults(tmp_path):
    tok = TextTokenizer.load(build_tiny_tokenizer_dir(tmp_path, ["hello", "world"]))
    assert tok.generation_defaults() == NEUTRAL_SAMPLING


def test_generation_config_of_a_directory(tmp_path):
    config = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1, "eos_token_id": [1, 3]}
    tok = TextTokenizer.load(build_tiny_tokenizer_dir(tmp_path, ["hello", "world"], config))
    assert tok.generation_defaults() == {"temperature": 0.6, "top_p": 1.0, "top_k": 20, "min_p": 0.0,
                                         "repetition_penalty": 1.1}
    assert tok.eos_token_ids == [1, 3]

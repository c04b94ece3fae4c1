"""IncrementalDetokenizer with the real default-model tokenizer: exact, append-only, no broken characters.

Every case runs twice: with tokenizers' DecodeStream (the default) and with the Python window method.
"""

import random

import pytest

from services.tokenizer.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.tokenizer.helpers import byte_token_ids

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 42 degrees!",
    "code": 'def area(r: float) -> float:\n    """Circle."""\n    return 3.14159 * r ** 2  # ✓\n',
    "emoji": "Party 🎉🥳 family 👨‍👩‍👧‍👦 flags 🇯🇵 done 😀",
    "cjk": "東京は日本の首都です。中文文本，한국어 텍스트도。",
    "thai": "ภาษาไทยเป็นภาษาที่มีวรรณยุกต์ สวัสดีครับ",
    "mixed": "Prix: 12,50 € — naïve café, Ωμέγα, привет, مرحبا, 🚀 and 漢字 ok",
}
PROMPT = "Write something:"
_MODE = {"use_decode_stream": True}


@pytest.fixture(autouse=True, params=[True, False], ids=["decode_stream", "window"])
def detokenizer_mode(request):
    _MODE["use_decode_stream"] = request.param
    yield request.param
    _MODE["use_decode_stream"] = True


def make_detokenizer(tok, prompt_ids=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens, use_decode_stream=_MODE["use_decode_stream"])
    uses_stream = detok._stream is not None
    assert uses_stream == (_MODE["use_decode_stream"] and not isinstance(tok, CountingTokenizer))
    return detok


def stream(tok, prompt_ids, output_ids, skip_special_tokens=True, chunk_sizes=(1,)):
    """Feed `output_ids` in chunks cycling through `chunk_sizes`; return the deltas (flush included)."""
    detok = make_detokenizer(tok, prompt_ids, skip_special_tokens)
    deltas, start, i = [], 0, 0
    while start < len(output_ids):
        size = chunk_sizes[i % len(chunk_sizes)]
        deltas.append(detok.step(output_ids[start : start + size]))
        start, i = start + size, i + 1
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def assert_append_only(deltas, final):
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert final.startswith(emitted)
    assert emitted == final


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_deltas_equal_the_full_decode(text_tokenizer, name):
    tok = text_tokenizer
    output_ids = tok.encode(TEXTS[name], add_special_tokens=False)
    deltas = stream(tok, tok.encode(PROMPT), output_ids)
    assert "".join(deltas) == tok.decode(output_ids) == TEXTS[name]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_text_is_released_as_soon_as_a_token_completes_its_characters(text_tokenizer, name):
    tok = text_tokenizer
    output_ids = tok.encode(TEXTS[name], add_special_tokens=False)
    detok = make_detokenizer(tok, tok.encode(PROMPT))
    settled_text = ""
    for k in range(1, len(output_ids) + 1):
        detok.step(output_ids[k - 1 : k])
        text_so_far = tok.decode(output_ids[:k])
        if not text_so_far.endswith(REPLACEMENT_CHAR):
            settled_text = text_so_far
        assert detok.text == settled_text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_from_the_vocabulary(text_tokenizer, skip_special_tokens):
    tok = text_tokenizer
    rng = random.Random(1234)
    for _ in range(8):
        output_ids = [rng.randrange(tok.vocab_size) for _ in range(400)]
        prompt_ids = tok.encode("Random: ")
        deltas = stream(tok, prompt_ids, output_ids, skip_special_tokens, chunk_sizes=(1, 3, 1, 2, 7))
        assert_append_only(deltas, tok.decode(output_ids, skip_special_tokens))


def test_random_ids_hit_characters_split_across_tokens(text_tokenizer):
    """Guard for the test above: its sequences do contain tokens that are not whole characters."""
    tok = text_tokenizer
    rng = random.Random(1234)
    ids = [rng.randrange(tok.vocab_size) for _ in range(400)]
    assert sum(REPLACEMENT_CHAR in tok.decode([i]) for i in ids) >= 1


@pytest.mark.parametrize("char", ["😀", "中", "ก", "é", "👨‍👩‍👧"])
def test_a_character_split_into_single_byte_tokens(text_tokenizer, char):
    tok = text_tokenizer
    output_ids = byte_token_ids(tok, f"a{char}b".encode())
    detok = make_detokenizer(tok, tok.encode(PROMPT))
    deltas = [detok.step([token_id]) for token_id in output_ids] + [detok.flush()]
    assert "".join(deltas) == f"a{char}b"
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    if len(char) == 1:
        num_bytes = len(char.encode())
        assert deltas[1 : 1 + num_bytes] == [""] * (num_bytes - 1) + [char]


def test_prompt_that_ends_mid_character(text_tokenizer):
    tok = text_tokenizer
    emoji_bytes = "😀".encode()
    prompt_ids = tok.encode("Look: ") + byte_token_ids(tok, emoji_bytes[:2])
    output_ids = byte_token_ids(tok, emoji_bytes[2:]) + tok.encode(" done", add_special_tokens=False)
    deltas = stream(tok, prompt_ids, output_ids)
    assert "".join(deltas) == "😀 done"
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    prompt_text = tok.decode(prompt_ids).rstrip(REPLACEMENT_CHAR)
    assert prompt_text + "".join(deltas) == tok.decode(prompt_ids + output_ids)


def test_leading_space_of_the_first_token_survives(text_tokenizer):
    tok = text_tokenizer
    output_ids = tok.encode(" world", add_special_tokens=False)
    assert "".join(stream(tok, tok.encode("Hello"), output_ids)) == " world"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_skipped_or_kept(text_tokenizer, skip_special_tokens):
    tok = text_tokenizer
    output_ids = tok.encode("Hi", add_special_tokens=False) + [2] + tok.encode(" there", add_special_tokens=False)
    text = "".join(stream(tok, tok.encode(PROMPT), output_ids, skip_special_tokens))
    assert text == ("Hi there" if skip_special_tokens else "Hi<|im_end|> there")


def test_held_invalid_bytes_are_released_by_flush(text_tokenizer):
    tok = text_tokenizer
    output_ids = tok.encode("ok", add_special_tokens=False) + byte_token_ids(tok, "😀".encode()[:2])
    detok = make_detokenizer(tok, tok.encode(PROMPT))
    assert detok.step(output_ids) == "ok"
    assert detok.num_pending_ids == 2
    assert detok.flush() == tok.decode(output_ids)[len("ok") :]
    assert detok.flush() == ""


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, tok):
        self._tok = tok
        self.decode_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.decode_sizes.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_does_not_grow_with_the_output(text_tokenizer):
    tok = CountingTokenizer(text_tokenizer)
    output_ids = text_tokenizer.encode(" ".join(TEXTS.values()) * 4, add_special_tokens=False)
    deltas = stream(tok, text_tokenizer.encode(PROMPT), output_ids)
    assert "".join(deltas) == text_tokenizer.decode(output_ids)
    assert len(output_ids) > 500
    assert max(tok.decode_sizes) <= 12
    assert len(tok.decode_sizes) <= 2 * len(output_ids) + 10


def test_a_transformers_tokenizer_works_as_the_decoder(text_tokenizer):
    tok = text_tokenizer
    output_ids = tok.encode(TEXTS["mixed"], add_special_tokens=False)
    detok = make_detokenizer(tok.hf_tokenizer, tok.encode(PROMPT))
    assert detok.step(output_ids) + detok.flush() == TEXTS["mixed"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_both_methods_give_the_same_deltas_step_by_step(text_tokenizer, skip_special_tokens, detokenizer_mode):
    if not detokenizer_mode:
        pytest.skip("compares the two methods once")
    tok = text_tokenizer
    rng = random.Random(99)
    for trial in range(6):
        output_ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
        prompt_ids = tok.encode("Go: ") + byte_token_ids(tok, "😀".encode()[: trial % 4])
        stream_detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
        window_detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens, use_decode_stream=False)
        for token_id in output_ids:
            assert stream_detok.step([token_id]) == window_detok.step([token_id])
            assert stream_detok.num_pending_ids == window_detok.num_pending_ids
        assert stream_detok.flush() == window_detok.flush()

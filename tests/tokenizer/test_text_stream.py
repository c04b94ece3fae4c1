"""TextStream (detokenizer + stop strings) on real token ids."""

from services.tokenizer.text_stream import TextStream
from tests.tokenizer.helpers import byte_token_ids


def stream_text(tok, output_ids, stops, include=False):
    """Push ids one at a time through a TextStream; return (deltas, matched stop)."""
    text_stream = TextStream(tok, tok.encode("Say:"), stops, include)
    deltas = []
    for token_id in output_ids:
        delta, matched = text_stream.push([token_id])
        deltas.append(delta)
        if matched is not None:
            assert text_stream.text == "".join(deltas)
            return deltas, matched
    deltas.append(text_stream.finish())
    assert text_stream.text == "".join(deltas)
    return deltas, None


def assert_never_shows_cut_text(deltas, expected):
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)
    assert emitted == expected


def test_stream_stop_string_spanning_tokens(text_tokenizer):
    tok = text_tokenizer
    text, stop = "The answer is 42.195 km, not more.", "42.19"
    output_ids = tok.encode(text, add_special_tokens=False)
    assert not any(stop in tok.decode([i]) for i in output_ids)
    deltas, matched = stream_text(tok, output_ids, [stop])
    assert matched == stop
    assert_never_shows_cut_text(deltas, "The answer is ")


def test_stream_stop_string_ending_inside_a_token(text_tokenizer):
    tok = text_tokenizer
    text, stop = "Please understand everything now.", "under"
    output_ids = tok.encode(text, add_special_tokens=False)
    token_texts = [tok.decode([i]) for i in output_ids]
    assert any(t.endswith("understand") for t in token_texts)
    for include, expected in ((False, "Please "), (True, "Please under")):
        deltas, matched = stream_text(tok, output_ids, [stop], include)
        assert matched == stop
        assert_never_shows_cut_text(deltas, expected)


def test_stream_emoji_stop_string_split_across_byte_tokens(text_tokenizer):
    tok = text_tokenizer
    output_ids = byte_token_ids(tok, "go 🎉🎉 end".encode())
    deltas, matched = stream_text(tok, output_ids, ["🎉🎉"])
    assert matched == "🎉🎉"
    assert_never_shows_cut_text(deltas, "go ")


def test_stream_without_a_match_releases_the_held_tail(text_tokenizer):
    tok = text_tokenizer
    output_ids = tok.encode("It was a buzz", add_special_tokens=False)
    text_stream = TextStream(tok, tok.encode("Say:"), ["zzz top"])
    pushed = "".join(text_stream.push([i])[0] for i in output_ids)
    assert not pushed.endswith("zz")
    assert pushed + text_stream.finish() == "It was a buzz"
    assert text_stream.matched_stop is None


def test_stream_earliest_of_several_stop_strings(text_tokenizer):
    tok = text_tokenizer
    output_ids = tok.encode("one, two, three, four", add_special_tokens=False)
    deltas, matched = stream_text(tok, output_ids, ["four", "two"])
    assert matched == "two"
    assert_never_shows_cut_text(deltas, "one, ")


def test_stream_drops_the_rest_of_a_multi_token_push(text_tokenizer):
    tok = text_tokenizer
    output_ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    text_stream = TextStream(tok, tok.encode("Say:"), ["beta"])
    assert text_stream.push(output_ids) == ("alpha ", "beta")
    assert text_stream.push(tok.encode(" more", add_special_tokens=False)) == ("", "beta")
    assert text_stream.finish() == ""
    assert text_stream.text == "alpha "


def test_special_tokens_are_skipped_unless_asked_for(text_tokenizer):
    tok = text_tokenizer
    ids = tok.encode("Hi there", add_special_tokens=False) + [tok.eos_token_ids[0]]
    special = tok.decode([tok.eos_token_ids[0]], skip_special_tokens=False)
    assert special and tok.decode([tok.eos_token_ids[0]]) == ""
    for stream, expected in ((TextStream(tok, []), "Hi there"),
                             (TextStream(tok, [], skip_special_tokens=False), "Hi there" + special)):
        deltas = [stream.push([token_id])[0] for token_id in ids]
        assert "".join(deltas) + stream.finish() == stream.text == expected

"""StopStringMatcher on text deltas, and TextStream (detokenizer + stop strings) on real token ids."""

import random

import pytest

from services.tokenizer.errors import InvalidRequestError
from services.tokenizer.stop import StopStringMatcher, TextStream
from tests.tokenizer.helpers import byte_token_ids


def run_matcher(stops, deltas, include=False):
    """Feed deltas; return (emitted pieces, matched stop). Stops feeding at a match, like the server."""
    matcher = StopStringMatcher(stops, include)
    pieces = []
    for delta in deltas:
        piece, matched = matcher.push(delta)
        pieces.append(piece)
        if matched is not None:
            return pieces, matched
    pieces.append(matcher.finish())
    return pieces, None


def reference_cut(text, stops, include):
    """The stop string that completes first in `text` (ties: starts first) and the text it leaves."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found)
    return text[: end if include else start], stop


def test_stop_string_spanning_deltas():
    pieces, matched = run_matcher(["STOP"], ["abc ST", "O", "P more"])
    assert matched == "STOP"
    assert pieces == ["abc ", "", ""]


def test_stop_string_ending_inside_a_delta_drops_the_rest():
    pieces, matched = run_matcher(["world"], ["hello wor", "ld! extra"])
    assert (pieces, matched) == (["hello ", ""], "world")


def test_include_stop_string_in_output():
    pieces, matched = run_matcher(["world"], ["hello wor", "ld! extra"], include=True)
    assert ("".join(pieces), matched) == ("hello world", "world")


def test_prefix_overlap():
    pieces, matched = run_matcher(["ab"], list("aab"))
    assert (pieces, matched) == (["", "a", ""], "ab")


def test_only_an_actual_prefix_is_held_back():
    matcher = StopStringMatcher(["xyz"])
    assert matcher.push("abc") == ("abc", None)
    assert matcher.push("abx") == ("ab", None)
    assert matcher.push("yw") == ("xyw", None)
    assert matcher.push("xy") == ("", None)
    assert matcher.finish() == "xy"


def test_the_stop_string_completing_first_wins():
    assert run_matcher(["cat", "dog"], ["the dog and the cat"])[1] == "dog"
    for deltas in (["xabcd"], list("xabcd"), ["xa", "bcd"]):
        pieces, matched = run_matcher(["abcd", "bc"], deltas)
        assert ("".join(pieces), matched) == ("xa", "bc")


def test_after_a_match_nothing_more_is_emitted():
    matcher = StopStringMatcher(["!"])
    assert matcher.push("hi! there") == ("hi", "!")
    assert matcher.push("more") == ("", "!")
    assert matcher.finish() == ""


def test_no_stop_strings_pass_text_through():
    assert run_matcher([], ["a", "b"]) == (["a", "b", ""], None)


@pytest.mark.parametrize("stops", [["ok", ""], ["ok", 3]])
def test_invalid_stop_strings_name_their_index(stops):
    with pytest.raises(InvalidRequestError) as excinfo:
        StopStringMatcher(stops)
    assert excinfo.value.field == "stop[1]"


@pytest.mark.parametrize("include", [False, True])
def test_random_texts_and_splits_agree_with_a_reference(include):
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(1, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        expected_text, expected_stop = reference_cut(text, stops, include)
        pieces, matched = run_matcher(stops, deltas, include)
        assert matched == expected_stop
        emitted = ""
        for piece in pieces:
            emitted += piece
            assert expected_text.startswith(emitted)
        assert emitted == expected_text


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

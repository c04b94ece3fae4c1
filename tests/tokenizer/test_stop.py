"""StopStringMatcher on text deltas."""

import random

import pytest

from services.tokenizer.errors import InvalidRequestError
from services.tokenizer.stop import StopStringMatcher, validate_stop_strings


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


@pytest.mark.parametrize("stops, description", [(["ok", ""], "must not be empty"),
                                                 (["ok", 3], "must be a string, got int")])
def test_invalid_stop_strings_name_their_index(stops, description):
    with pytest.raises(InvalidRequestError) as excinfo:
        StopStringMatcher(stops)
    assert (excinfo.value.field, excinfo.value.description) == ("stop[1]", description)


def test_a_bare_string_is_not_a_list_of_stop_strings():
    with pytest.raises(InvalidRequestError) as excinfo:
        validate_stop_strings("stop here")
    assert (excinfo.value.field, excinfo.value.description) == ("stop", "must be a list of strings")
    assert validate_stop_strings(["b", "a", "b"]) == ["b", "a"]


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

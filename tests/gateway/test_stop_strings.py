"""Stop-string matching over deltas: spanning, holding back, multi-byte, earliest match."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.text.stop_strings import StopStringMatcher


def _run(stops, deltas):
    """Returns (emitted text, stopped) after feeding deltas and flushing if not stopped."""
    matcher = StopStringMatcher(stops)
    emitted = []
    for delta in deltas:
        result = matcher.feed(delta)
        emitted.append(result.text)
        if result.stopped:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


def test_no_stop_strings_pass_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc").text == "abc"
    assert matcher.flush() == ""


def test_stop_inside_one_delta_cuts_before_it():
    assert _run(["END"], ["hello END world"]) == ("hello ", True)


def test_stop_spanning_deltas_is_held_back_then_dropped():
    matcher = StopStringMatcher(["Hello"])
    first = matcher.feed("say Hel")
    assert (first.text, first.stopped) == ("say ", False)  # "Hel" could start the stop string
    second = matcher.feed("lo there")
    assert (second.text, second.stopped) == ("", True)


def test_held_text_is_released_when_the_match_fails():
    matcher = StopStringMatcher(["Hello"])
    assert matcher.feed("Hel").text == ""
    assert matcher.feed("p me").text == "Help me"


def test_held_text_is_flushed_at_the_end():
    assert _run(["Hello"], ["abc He"]) == ("abc He", False)


def test_stop_spanning_many_single_character_deltas():
    assert _run(["</answer>"], list("42</answer> trailing")) == ("42", True)


def test_multibyte_stop_string_across_deltas():
    assert _run(["日本"], ["東京は", "日", "本の首都"]) == ("東京は", True)
    assert _run(["😀!"], ["ok 😀", "!"]) == ("ok ", True)
    assert _run(["😀!"], ["ok 😀", "?"]) == ("ok 😀?", False)


def test_earliest_of_several_stop_strings_wins():
    assert _run(["world", "lo w"], ["hel", "lo world"]) == ("hel", True)


def test_overlapping_prefix_keeps_longest_candidate():
    # "aab": after "aa" both "a" and "aa" could start it; the longest must be held.
    assert _run(["aab"], ["xaa", "b"]) == ("x", True)
    assert _run(["aab"], ["xaa", "ab"]) == ("xa", True)


@given(
    text=st.text(alphabet="abé😀 ", max_size=30),
    stop=st.text(alphabet="abé😀 ", min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=6),
)
def test_matches_the_one_shot_answer_for_any_split(text, stop, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    position = text.find(stop)
    expected = (text, False) if position < 0 else (text[:position], True)
    assert _run([stop], deltas) == expected

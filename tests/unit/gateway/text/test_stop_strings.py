"""Tests for gateway.text.stop_strings: matching stop strings over chunked text."""

from __future__ import annotations

import random

import pytest

from gateway.text.stop_strings import StopResult, StopStringMatcher


def _feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, str | None]:
    """Feed chunks until a stop matches; return (emitted text, matched stop)."""
    emitted = []
    for chunk in chunks:
        result = matcher.feed(chunk)
        emitted.append(result.text)
        if result.matched is not None:
            return "".join(emitted), result.matched
    emitted.append(matcher.flush())
    return "".join(emitted), None


def _random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, 4)
        chunks.append(text[pos : pos + size])
        pos += size
    return chunks


def test_no_stops_passes_text_through_without_holding() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("Hello") == StopResult("Hello", None)
    assert matcher.feed(" wor") == StopResult(" wor", None)
    assert matcher.held_text == ""
    assert matcher.flush() == ""


def test_stop_inside_one_chunk() -> None:
    matcher = StopStringMatcher(["END"])
    result = matcher.feed("abc END def")
    assert result == StopResult("abc ", "END")
    assert matcher.is_stopped


def test_text_that_cannot_start_a_stop_is_released_at_once() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("hello") == StopResult("hello", None)
    assert matcher.held_text == ""


def test_stop_spanning_chunk_boundaries() -> None:
    matcher = StopStringMatcher(["<stop>"])
    assert matcher.feed("Paris is nice<s") == StopResult("Paris is nice", None)
    assert matcher.held_text == "<s"
    assert matcher.feed("to") == StopResult("", None)
    assert matcher.held_text == "<sto"
    assert matcher.feed("p> trailing") == StopResult("", "<stop>")


def test_held_prefix_that_turns_out_not_to_be_a_stop_is_released() -> None:
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.feed("line\n\nUs") == StopResult("line", None)
    assert matcher.feed("ually fine") == StopResult("\n\nUsually fine", None)
    assert matcher.held_text == ""


def test_flush_releases_held_text_when_no_stop_matched() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("the end ST") == StopResult("the end ", None)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""
    assert not matcher.is_stopped


def test_held_suffix_restarts_inside_a_failed_prefix() -> None:
    # "aaa" is not a prefix of "aab", but its last two characters are, so one "a" goes out.
    matcher = StopStringMatcher(["aab"])
    assert matcher.feed("xa") == StopResult("x", None)
    assert matcher.feed("a") == StopResult("", None)
    assert matcher.feed("a") == StopResult("a", None)
    assert matcher.held_text == "aa"
    assert matcher.feed("b!") == StopResult("", "aab")


def test_overlapping_stops_earliest_position_wins() -> None:
    matcher = StopStringMatcher(["bc", "ab"])
    assert matcher.feed("xabc") == StopResult("x", "ab")


def test_overlapping_stops_across_chunks() -> None:
    matcher = StopStringMatcher(["ab", "bc"])
    assert matcher.feed("xa") == StopResult("x", None)
    assert matcher.feed("bc") == StopResult("", "ab")


def test_stop_inside_a_longer_stop_wins_because_it_completes_first() -> None:
    # "bc" is complete at "abc" while "abcd" needs one more character; the documented rule
    # (first to complete) must give the same answer for every chunking.
    for chunks in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        matcher = StopStringMatcher(["abcd", "bc"])
        assert _feed_all(matcher, chunks) == ("a", "bc")


def test_stops_ending_together_prefer_the_longer() -> None:
    matcher = StopStringMatcher(["c", "abc"])
    assert matcher.feed("xxabc") == StopResult("xx", "abc")


def test_multi_char_unicode_stops() -> None:
    matcher = StopStringMatcher(["🛑", "終わり"])
    assert matcher.feed("東京は終") == StopResult("東京は", None)
    assert matcher.held_text == "終"
    assert matcher.feed("わ") == StopResult("", None)
    assert matcher.feed("り。") == StopResult("", "終わり")

    emoji = StopStringMatcher(["🛑"])
    assert emoji.feed("go 🙂 stop🛑 more") == StopResult("go 🙂 stop", "🛑")


def test_duplicate_stops_are_accepted() -> None:
    matcher = StopStringMatcher(["x", "x"])
    assert matcher.feed("abx") == StopResult("ab", "x")


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_empty_stop_string_is_rejected(stops: list[str]) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(stops)


def test_a_bare_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="sequence"):
        StopStringMatcher("stop")  # type: ignore[arg-type]


def test_feed_after_match_raises_and_flush_is_empty() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax").matched == "x"
    with pytest.raises(RuntimeError, match="already matched"):
        matcher.feed("more")
    assert matcher.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_result_does_not_depend_on_chunking(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["abc", "cab", "b\nb", "🙂🙂", "zz"]
    alphabet = "abcz\n🙂"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    whole = _feed_all(StopStringMatcher(stops), [text])
    chunked = _feed_all(StopStringMatcher(stops), _random_chunks(text, rng))
    by_char = _feed_all(StopStringMatcher(stops), list(text))
    assert chunked == whole
    assert by_char == whole
    emitted, matched = whole
    if matched is None:
        assert emitted == text
    else:
        assert text.startswith(emitted + matched)
        assert all(stop not in emitted for stop in stops)

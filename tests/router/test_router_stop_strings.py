"""StopStringMatcher: no part of a matched stop string ever reaches the client."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.stop_strings import StopStringMatcher

# A small alphabet makes stop strings, partial matches and overlaps frequent.
ALPHABET = "ab\n é"
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), min_size=0, max_size=4)


def chunked(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at the given positions (duplicates and any order allowed)."""
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Oracle: (start, stop) of the occurrence that ends first, ties to the longest."""
    best = None
    for stop in set(stops):
        i = text.find(stop)
        if i >= 0 and (best is None or (i + len(stop), i) < (best[0] + len(best[1]), best[0])):
            best = (i, stop)
    return best


def run(stops: list[str], chunks: list[str],
        include_stop: bool = False) -> tuple[list[str], str | None, str]:
    matcher = StopStringMatcher(stops, include_stop)
    emitted: list[str] = []
    for chunk in chunks:
        safe, stop = matcher.feed(chunk)
        emitted.append(safe)
        if stop is not None:
            return emitted, stop, matcher.flush()
    return emitted, None, matcher.flush()


@settings(max_examples=600, deadline=None)
@given(text=texts, stops=stop_lists, cuts=st.lists(st.integers(0, 40), max_size=12))
def test_emits_exactly_the_text_before_the_first_stop(text, stops, cuts):
    emitted, matched, flushed = run(stops, chunked(text, cuts))
    expected = first_stop(text, stops)
    if expected is None:
        assert matched is None
        assert "".join(emitted) + flushed == text
    else:
        start, stop = expected
        assert matched == stop
        assert flushed == ""
        assert "".join(emitted) == text[:start]


@settings(max_examples=400, deadline=None)
@given(text=texts, stops=stop_lists, cuts=st.lists(st.integers(0, 40), max_size=12))
def test_no_emitted_prefix_ever_reaches_into_the_matched_stop(text, stops, cuts):
    """At every point in the stream, what was sent ends before the stop starts."""
    expected = first_stop(text, stops)
    matcher = StopStringMatcher(stops)
    sent = ""
    for chunk in chunked(text, cuts):
        safe, stop = matcher.feed(chunk)
        sent += safe
        if expected is not None:
            assert len(sent) <= expected[0]
        if stop is not None:
            break
    assert text.startswith(sent)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="xyz", max_size=40), stops=st.lists(
    st.text(alphabet="ab", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=12))
def test_text_that_cannot_start_a_stop_is_released_at_once(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    for chunk in chunked(text, cuts):
        assert matcher.feed(chunk) == (chunk, None)
    assert matcher.flush() == ""


def test_holds_only_a_real_prefix_and_releases_it_when_it_breaks():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("Paris is <") == ("Paris is ", None)
    assert matcher.held == "<"
    assert matcher.feed("/") == ("", None)
    assert matcher.feed("b>") == ("</b>", None)
    assert matcher.held == ""


@settings(max_examples=300, deadline=None)
@given(text=texts, stops=stop_lists, cuts=st.lists(st.integers(0, 40), max_size=12))
def test_include_stop_emits_the_text_through_the_first_stop(text, stops, cuts):
    emitted, matched, flushed = run(stops, chunked(text, cuts), include_stop=True)
    expected = first_stop(text, stops)
    if expected is None:
        assert matched is None and "".join(emitted) + flushed == text
    else:
        start, stop = expected
        assert (matched, flushed) == (stop, "")
        assert "".join(emitted) == text[:start + len(stop)]


def test_include_stop_keeps_a_stop_split_across_chunks_and_drops_what_follows():
    matcher = StopStringMatcher(["\n\nUser:"], include_stop=True)
    assert matcher.feed("Paris.\n") == ("Paris.", None)
    assert matcher.feed("\nUs") == ("", None)
    assert matcher.feed("er: and more") == ("\n\nUser:", "\n\nUser:")
    assert matcher.match_end == 3  # as without include_stop: ids end at the same token
    assert matcher.feed("later") == ("", "\n\nUser:")
    assert matcher.flush() == ""


def test_match_across_chunks_drops_the_stop_and_everything_after():
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.feed("Paris.\n") == ("Paris.", None)
    assert matcher.feed("\nUs") == ("", None)
    assert matcher.feed("er: and more") == ("", "\n\nUser:")
    assert matcher.matched == "\n\nUser:"
    assert matcher.feed("later text") == ("", "\n\nUser:")
    assert matcher.flush() == ""


def test_first_completed_stop_wins_whatever_the_chunking():
    stops = ["abcd", "c"]
    assert run(stops, ["abcd"]) == (["ab"], "c", "")
    assert run(stops, ["a", "b", "c", "d"]) == (["", "", "ab"], "c", "")


def test_longest_stop_wins_a_tie_on_the_end():
    assert run(["b", "ab"], ["xab"]) == (["x"], "ab", "")


def test_flush_releases_a_held_partial_stop_at_the_end():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("done ST") == ("done ", None)
    assert matcher.flush() == "ST"


def test_no_stops_is_a_pass_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_empty_and_duplicate_stops_are_ignored():
    matcher = StopStringMatcher(["", "x", "x"])
    assert matcher.stops == ("x",)
    assert matcher.feed("abxc") == ("ab", "x")


def test_match_end_counts_the_completing_delta_through_the_stop():
    """``match_end`` is in the coordinates of the delta that completed the stop,
    whatever part of the stop was held back from earlier deltas."""
    matcher = StopStringMatcher(["User:"])
    assert matcher.match_end is None
    assert matcher.feed("Hi Us") == ("Hi ", None)
    assert matcher.feed("er: more") == ("", "User:")
    assert matcher.match_end == len("er:")
    whole = StopStringMatcher(["b,"])
    assert whole.feed("a, b, c, d") == ("a, ", "b,")
    assert whole.match_end == len("a, b,")

"""Stop strings over streamed text: held back while they might still match, cut when they do."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.stopping import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """Feed every piece; return what each feed released (plus the flush) and `stopped`."""
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    out.append(m.flush())
    return out, m.stopped


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher([])
    assert [m.feed(p) for p in ("Hel", "lo", " wor")] == ["Hel", "lo", " wor"]
    assert m.flush() == "" and not m.stopped


def test_empty_stop_strings_are_ignored() -> None:
    assert run(["", ""], ["ab", "c"]) == (["ab", "c", ""], False)


def test_stop_inside_one_piece_cuts_before_it() -> None:
    m = StopMatcher(["END"])
    assert m.feed("done ENDtrailing") == "done "
    assert m.stopped
    assert m.feed("more") == ""  # nothing after a stop is ever released
    assert m.flush() == ""


def test_stop_spanning_pieces_is_never_half_shown() -> None:
    out, stopped = run(["world"], ["Hel", "lo wo", "rl", "d! and more"])
    # "wo" and "worl" could still become "world", so they are held, then dropped
    assert out == ["Hel", "lo ", "", "", ""]
    assert stopped


def test_held_text_is_released_when_the_match_fails() -> None:
    out, stopped = run(["world"], ["Hello wo", "rk", "s"])
    assert out == ["Hello ", "work", "s", ""]
    assert not stopped


def test_flush_releases_a_pending_prefix_at_the_end() -> None:
    out, stopped = run(["</s>"], ["answer </"])
    assert out == ["answer ", "</"]
    assert not stopped


def test_repeated_prefix_characters() -> None:
    # "aaab": the stop "aab" starts at index 1; the first "a" is safe to show
    out, stopped = run(["aab"], ["a", "a", "a", "b"])
    assert "".join(out) == "a" and stopped


def test_earliest_of_several_stops_wins() -> None:
    out, stopped = run(["c", "abc", "zz"], ["xab", "cde"])
    assert "".join(out) == "x" and stopped


def test_the_first_stop_to_complete_wins() -> None:
    # after "ab" the stop "b" is complete; "aba" (which would start earlier) is not yet
    assert "".join(run(["b", "aba"], ["ab", "a"])[0]) == "a"
    assert "".join(run(["b", "aba"], ["aba"])[0]) == ""  # both complete in one piece


def test_stop_spanning_a_multibyte_character_boundary() -> None:
    out, stopped = run(["🦊 f"], ["H", "é", "🦊", " ", "f", "ox"])
    assert "".join(out) == "Hé" and stopped


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_streamed_output_equals_text_cut_at_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    """However the text is split, generation stops at the first piece after which a stop
    string is complete, and the released text is everything before the leftmost stop seen
    by then; every intermediate release is a prefix of it (nothing shown is taken back)."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    expected, stops_here = text, False
    for end in bounds[1:]:
        hits = [text[:end].find(s) for s in stops if s in text[:end]]
        if hits:
            expected, stops_here = text[: min(hits)], True
            break
    out, stopped = run(stops, pieces)
    assert "".join(out) == expected
    assert stopped == stops_here
    shown = ""
    for piece in out:
        shown += piece
        assert expected.startswith(shown)

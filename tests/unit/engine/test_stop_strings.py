"""The incremental stop-string matcher against a reference that rescans the whole text."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.engine.stop_strings import StopStringMatcher


def reference(
    pieces: list[str], stops: list[str], include: bool, checks: list[bool]
) -> tuple[list[str], str | None]:
    """The text visible after each piece (the whole text scanned every time), and the stop."""
    hold = max(len(s) for s in stops) - 1
    text = ""
    visible: list[str] = []
    for piece, check in zip(pieces, checks, strict=True):
        text += piece
        if check:
            best = None
            for stop in stops:
                idx = text.find(stop, max(0, len(text) - len(piece) - len(stop) + 1))
                if idx != -1 and (best is None or idx < best[0]):
                    best = (idx, stop)
            if best is not None:
                idx, stop = best
                visible.append(text[: idx + len(stop)] if include else text[:idx])
                return visible, stop
        shown = text if include else text[: max(len(text) - hold, 0)]
        visible.append(max(shown, visible[-1] if visible else "", key=len))
    visible.append(text)  # the end: everything held back is released
    return visible, None


def run(
    pieces: list[str], stops: list[str], include: bool, checks: list[bool]
) -> tuple[list[str], str | None]:
    matcher = StopStringMatcher(stops, include)
    released = ""
    visible = []
    for piece, check in zip(pieces, checks, strict=True):
        out, stop = matcher.add(piece, check)
        released += out
        visible.append(released)
        if stop is not None:
            return visible, stop
    visible.append(released + matcher.flush())
    return visible, None


ALPHABET = "abc"


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.text(ALPHABET, max_size=4), max_size=30),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    min_pieces=st.integers(0, 5),
)
def test_matches_the_whole_text_rescan(
    pieces: list[str], stops: list[str], include: bool, min_pieces: int
) -> None:
    checks = [i >= min_pieces for i in range(len(pieces))]
    assert run(pieces, stops, include, checks) == reference(pieces, stops, include, checks)


def test_a_stop_split_over_many_pieces_is_found_and_never_released() -> None:
    matcher = StopStringMatcher(["STOP", "xy"], include_stop_str=False)
    released = []
    for piece in ["hello S", "T", "O", "P tail"]:
        out, stop = matcher.add(piece)
        released.append(out)
    assert "".join(released) == "hello "
    assert stop == "STOP"
    assert all("S" not in r for r in released)


def test_work_per_piece_is_bounded_by_the_stops_not_the_text() -> None:
    matcher = StopStringMatcher(["<end>"], include_stop_str=False)
    rng = random.Random(0)
    for _ in range(5000):
        matcher.add("".join(rng.choice("ab<>") for _ in range(3)))
        assert len(matcher._tail) <= 4  # never more than the longest stop less one


def test_empty_stops_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher([], include_stop_str=False)
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["a", ""], include_stop_str=True)

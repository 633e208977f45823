"""Stop strings over text that arrives a piece at a time, in time bounded by the new piece.

A stop string may start in text seen at an earlier step, so the matcher keeps the last
`len(longest stop) - 1` characters (the tail) and searches only the tail plus the new piece:
every earlier start was already searched. Unless the stop string is to be included in the
output, the tail is also held back from the caller, so text once released never has to be
taken back when a stop string completes in a later piece.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include_stop_str: bool) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = tuple(stops)
        self.include_stop_str = include_stop_str
        self._keep = max(len(s) for s in self.stops) - 1
        self._tail = ""  # the last `_keep` characters of the text so far
        self._held = 0  # how many characters at the end of the tail are not yet released

    def add(self, piece: str, check: bool = True) -> tuple[str, str | None]:
        """Take the next piece of text; return (text to release now, the stop string that
        ended the text or None). When a stop string is found, the released text ends just
        before it (or just after it with `include_stop_str`) and the matcher is done.
        `check=False` extends the text without looking for stop strings (min_tokens)."""
        window = self._tail + piece
        released = len(self._tail) - self._held  # where the unreleased text starts in window
        if check:
            found = self._find(window)
            if found is not None:
                idx, stop = found
                end = idx + len(stop) if self.include_stop_str else idx
                self._tail, self._held = "", 0
                return window[released : max(end, released)], stop
        keep = min(len(window), self._keep)
        self._tail = window[len(window) - keep :] if keep else ""
        if self.include_stop_str:
            self._held = 0
            return window[released:], None
        self._held = keep
        return window[released : len(window) - keep], None

    def flush(self) -> str:
        """The text ended without a stop string: release what is still held back."""
        held = self._tail[len(self._tail) - self._held :] if self._held else ""
        self._tail, self._held = "", 0
        return held

    def _find(self, window: str) -> tuple[int, str] | None:
        """The earliest stop string that ends in the new piece (starts past the old tail's
        first `len(tail) - len(stop) + 1` characters: those starts were searched before)."""
        best: tuple[int, str] | None = None
        tail = len(self._tail)
        for stop in self.stops:
            idx = window.find(stop, max(0, tail - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

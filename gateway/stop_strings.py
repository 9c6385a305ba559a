"""Stop-string matching over a stream of text deltas.

A stop string may span deltas ("Hel" + "lo" for stop "Hello"), so text that
could be the start of a stop string is held back until the next delta decides
it. Matching works on decoded text (code points): the detokenizer never emits
half a character, so a multi-byte stop string cannot be split mid-character.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    """What to send for one delta: `text` is safe to emit; `stopped` ends the stream."""

    text: str
    stopped: bool


class StopStringMatcher:
    """Filters one stream's text; generation ends before the earliest stop string.

    Invariant: the held-back text never contains a whole stop string, and it is
    the longest suffix of the text seen so far that is a proper prefix of some
    stop string.
    """

    def __init__(self, stop_strings: Sequence[str]):
        assert all(stop_strings), "empty stop strings are rejected at the edge"
        self._stops = tuple(stop_strings)
        self._held = ""
        self._stopped = False

    def feed(self, delta: str) -> StopResult:
        assert not self._stopped, "feed after a stop string matched"
        if not self._stops:
            return StopResult(delta, stopped=False)
        text = self._held + delta
        cut = self._earliest_match(text)
        if cut is not None:
            self._held = ""
            self._stopped = True
            return StopResult(text[:cut], stopped=True)
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep :]
        return StopResult(text[: len(text) - keep], stopped=False)

    def flush(self) -> str:
        """Returns held-back text once the stream ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> int | None:
        positions = [pos for stop in self._stops if (pos := text.find(stop)) >= 0]
        return min(positions) if positions else None

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

"""Stop-string matching over a stream of text deltas: text that could begin a stop string
is held back until the next delta decides it. Matching is on decoded text, and the
detokenizer never emits half a character."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    """What to send for one delta: `text` is safe to emit; `stopped` ends the stream."""

    text: str
    stopped: bool


def _failure(stop: str) -> list[int]:
    """KMP's prefix function: fail[i] = length of the longest proper prefix of
    stop[:i + 1] that is also its suffix."""
    fail = [0] * len(stop)
    length = 0
    for i in range(1, len(stop)):
        while length and stop[i] != stop[length]:
            length = fail[length - 1]
        if stop[i] == stop[length]:
            length += 1
        fail[i] = length
    return fail


class StopStringMatcher:
    """Filters one stream's text; generation ends before the earliest stop string.

    Invariant: the held-back text never contains a whole stop string, and is the longest
    suffix of the text so far that is a proper prefix of some stop string. Linear in the
    delta whatever the stops: each stop keeps a KMP state (a search over candidate
    lengths cost ~1.5 ms a delta for adversarial stops)."""

    def __init__(self, stop_strings: Sequence[str]):
        assert all(stop_strings), "empty stop strings are rejected at the edge"
        self._stops = tuple(stop_strings)
        self._failures = tuple(_failure(stop) for stop in self._stops)
        self._states = [0] * len(self._stops)
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
        keep = self._advance(delta)
        self._held = text[len(text) - keep :]
        return StopResult(text[: len(text) - keep], stopped=False)

    def flush(self) -> str:
        """Returns held-back text once the stream ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> int | None:
        positions = [pos for stop in self._stops if (pos := text.find(stop)) >= 0]
        return min(positions) if positions else None

    def _advance(self, delta: str) -> int:
        """Feeds `delta` to every stop's KMP state; returns the longest partial match
        (no stop matches whole here, so each state stays a proper prefix length)."""
        longest = 0
        for index, stop in enumerate(self._stops):
            state = self._states[index]
            if state or stop[0] in delta:  # a stop not begun and not begun now stays at 0
                fail = self._failures[index]
                for char in delta:
                    while state and stop[state] != char:
                        state = fail[state - 1]
                    if stop[state] == char:
                        state += 1
                self._states[index] = state
            longest = max(longest, state)
        return longest

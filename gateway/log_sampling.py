"""One log line a second for an event that comes in crowds (overload refusals).

A burst of a thousand requests refused as overload is one event for an operator, not
a thousand: each line costs the gateway's intake a write under the GIL at the moment
it is busiest (measured with py-spy during ``benchmarks.reliability --only burst``:
about a tenth of the gateway's samples were the refusals' log lines). ``Sampled``
logs the first occurrence at once and then at most one line per ``every_s``, carrying
how many occurrences it stands for; the metrics still count every one.
"""

from __future__ import annotations

import threading
import time


class Sampled:
    """Logs ``event`` on ``log`` at ``level`` at most once per ``every_s``."""

    def __init__(self, log, level: str, event: str, every_s: float = 1.0,
                 clock=time.monotonic):
        self._emit = getattr(log, level)
        self._event = event
        self._every_s = every_s
        self._clock = clock
        self._next_at = float("-inf")
        self._unlogged = 0
        self._lock = threading.Lock()

    def __call__(self, **fields) -> bool:
        """Counts one occurrence; logs it (with ``occurrences``, this one and those
        not logged since the last line) when a line is due. True when it logged."""
        now = self._clock()
        with self._lock:
            self._unlogged += 1
            if now < self._next_at:
                return False
            occurrences, self._unlogged = self._unlogged, 0
            self._next_at = now + self._every_s
        self._emit(self._event, occurrences=occurrences, **fields)
        return True

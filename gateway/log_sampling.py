"""One log line a second for an event that comes in crowds (overload refusals): each line
costs the gateway's intake a write under the GIL when it is busiest (py-spy during
``benchmarks.reliability --only burst``: about a tenth of the gateway's samples). The first
is logged at once, then one per ``every_s`` with the count it stands for; metrics count all."""

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

"""``continuum serve``'s crash-loop guard: how many executor deaths a window may hold.

Every executor death counts, the cold restart and the warm-standby takeover alike (a
hung executor the supervisor kills is a death too). The guard exists to stop a crash
loop, something that kills every executor it is given (poisoned weights, a broken
driver, memory the host does not have), from burning the CPU for ever while the server
looks up and hides the failure. A takeover is cheap for the clients (no process start
on their path), but the executor still died, and the replacement standby the
supervisor starts next loads the model just as a cold start does: a loop of deaths
with standbys is still a crash loop, so it spends the same budget in the same window.
A takeover budget of its own would only let a poisoned server run longer before it
says so.

``--max-executor-restarts N`` (default 5) replacements within ``--restart-window-s S``
(default 120; fields of continuum/serve/config.py's ServeConfig): the (N+1)-th death
within S seconds stops the whole server with a line that names both flags. ``N = 0``
never replaces an executor: its first death stops the
server (for an orchestrator that restarts the pod itself). A standby that keeps dying
spends a budget of its own, of the same size, and when that is spent serving goes on
without a standby rather than stopping.
"""

from __future__ import annotations

from collections import deque


class RestartGuard:
    """Deaths within the last ``window_s`` seconds, against a budget of ``max_restarts``."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._deaths: deque[float] = deque()

    def record(self, now: float) -> bool:
        """Records a death at ``now`` (monotonic seconds); True while it may be replaced."""
        while self._deaths and now - self._deaths[0] >= self.window_s:
            self._deaths.popleft()
        self._deaths.append(now)
        return len(self._deaths) <= self.max_restarts

    @property
    def count(self) -> int:
        """Deaths in the window as of the last ``record``."""
        return len(self._deaths)

    def progress(self) -> str:
        """E.g. "2 of 5 in the last 120 s": for the line each replacement logs."""
        return f"{self.count} of {self.max_restarts} in the last {self.window_s:g} s"

    def tripped(self, code: int | None) -> str:
        """The line serve prints when the budget is spent, before it stops."""
        return (f"the executor exited with code {code}: {self.count} executor deaths "
                f"(restarts and standby takeovers) within {self.window_s:g} s, more than "
                f"--max-executor-restarts {self.max_restarts} allows within "
                f"--restart-window-s {self.window_s:g}: a crash loop; stopping. If the "
                "deaths are expected (fault injection, a benchmark), raise "
                "--max-executor-restarts")

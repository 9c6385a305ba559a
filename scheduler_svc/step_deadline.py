"""How long the scheduler waits for a step before it calls the executor hung.

A fixed floor makes every hang cost seconds of stalled streams; a deadline from the
measured step times detects one sooner, while the step's planned work stretches its own
deadline so a long prefill is never mistaken for a hang:

    deadline(n) = max(FLOOR_S, FACTOR × (p99 step time + max(0, n - m) × per-token cost))

``n``: the step's planned tokens, ``m``: the recent steps' median. The p99 is of steps
like the median one (at most 2m + PREFILL_MIN_TOKENS tokens); the per-token cost is the
p99 of seconds per token over recent steps of at least PREFILL_MIN_TOKENS (small steps
are mostly fixed cost), else the executor's Hello's prefill rate. Before WARMUP_STEPS
(compiles, page faults) it is COLD_FLOOR_S + COLD_FACTOR × the expected time. History
restarts with each executor. Pure Python: the loop feeds it.
"""

from __future__ import annotations

import collections

FLOOR_S = 1.0
FACTOR = 3.0
COLD_FLOOR_S = 5.0
COLD_FACTOR = 4.0
LIMIT_FACTOR = 2.0
WARMUP_STEPS = 8
WINDOW = 256  # recent steps the p99 is taken over
PREFILL_MIN_TOKENS = 64
MIN_COST_SAMPLES = 4
DEFAULT_TOKENS_PER_S = 100.0  # an executor that measured nothing


def _p99(values) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class StepDeadlines:
    """Recent step times of the current executor, and the deadline they imply."""

    def __init__(self, floor_s: float = FLOOR_S, factor: float = FACTOR,
                 cold_floor_s: float = COLD_FLOOR_S, warmup_steps: int = WARMUP_STEPS) -> None:
        self.floor_s, self.factor = floor_s, factor
        self.cold_floor_s, self.warmup_steps = cold_floor_s, warmup_steps
        self._rate = DEFAULT_TOKENS_PER_S
        self._steps: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._tokens: collections.deque[int] = collections.deque(maxlen=WINDOW)
        self._per_token: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._cached: tuple[float, int, float] | None = None  # p99 s, median n, s/token

    def reset(self, prefill_tokens_per_s: float) -> None:
        """A new executor: forget the old one's times; ``prefill_tokens_per_s`` from its
        Hello bounds the per-token cost from below."""
        self._rate = prefill_tokens_per_s if prefill_tokens_per_s > 0 else DEFAULT_TOKENS_PER_S
        self._steps.clear()
        self._tokens.clear()
        self._per_token.clear()
        self._cached = None

    def observe(self, elapsed_s: float, num_tokens: int) -> None:
        """A step of ``num_tokens`` planned tokens took ``elapsed_s`` (wall, as the
        scheduler saw it: from when the executor could start it to its answer)."""
        self._steps.append(elapsed_s)
        self._tokens.append(num_tokens)
        if num_tokens >= PREFILL_MIN_TOKENS:
            self._per_token.append(elapsed_s / num_tokens)
        self._cached = None

    @property
    def warm(self) -> bool:
        return len(self._steps) >= self.warmup_steps

    def p99_step_s(self) -> float:
        return self._stats()[0]

    def _stats(self) -> tuple[float, int, float]:
        if self._cached is None:
            per_token = (_p99(self._per_token) if len(self._per_token) >= MIN_COST_SAMPLES
                         else 1.0 / self._rate)
            if self._steps:
                median = sorted(self._tokens)[len(self._tokens) // 2]
                # The p99 of steps like the median one: a few big ones (a recompute after
                # a takeover) are paid for by the per-token term, not by every deadline.
                like = [t for t, n in zip(self._steps, self._tokens, strict=True)
                        if n <= 2 * median + PREFILL_MIN_TOKENS]
                self._cached = (_p99(like), median, per_token)
            else:
                self._cached = (0.0, 0, per_token)
        return self._cached

    def deadline(self, num_tokens: int) -> float:
        """Seconds a step of ``num_tokens`` planned tokens may take before it is a hang."""
        if not self.warm:
            return self._cold(num_tokens)
        return max(self.floor_s, self.factor * self._expected(num_tokens))

    def limit(self, num_tokens: int) -> float:
        """The most a step may take while its executor is seen working (a starved CPU,
        scheduler_svc/hang_check.py): LIMIT_FACTOR times the cold rule."""
        return LIMIT_FACTOR * self._cold(num_tokens)

    def _cold(self, num_tokens: int) -> float:
        return self.cold_floor_s + COLD_FACTOR * self._expected(num_tokens)

    def _expected(self, num_tokens: int) -> float:
        p99, typical, per_token = self._stats()
        return p99 + max(0, num_tokens - typical) * per_token

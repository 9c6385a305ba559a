"""The loop's count of answered steps and how long each ran, for Stats (the policy
comparison reads the decode steps that also carried prompt work), the step deadline and
benchmarks (the executor's idle time before each plan)."""

from __future__ import annotations

import collections
import time

from scheduler_svc.core import SchedulerOutput


class StepStats:
    __slots__ = ("num_steps", "num_decode_steps", "num_stalled_decode_steps",
                 "num_stalled_prefill_tokens", "executor_idle_ms", "_last_answer_at")

    def __init__(self) -> None:
        self.num_steps = 0
        # Steps in which some sequence decoded, and those of them that also carried
        # prefill (the decodes waited for prompt work), with that prefill's tokens.
        self.num_decode_steps = 0
        self.num_stalled_decode_steps = 0
        self.num_stalled_prefill_tokens = 0
        # The executor's idle time before each plan (StepResult.idle_ms).
        self.executor_idle_ms: collections.deque[float] = collections.deque(maxlen=100_000)
        self._last_answer_at = 0.0

    def answered(self, out: SchedulerOutput, sent_at: float, idle_ms: float
                 ) -> tuple[float, float]:
        """Counts ``out``, sent at ``sent_at`` and answered now. Returns (now, how long
        it ran): it started when sent or when the step before it ended, if later."""
        now = time.monotonic()
        elapsed = now - max(sent_at, self._last_answer_at)
        self._last_answer_at = now
        self.num_steps += 1
        if out.num_batched_tokens > out.num_prefill_tokens:  # some sequence decoded
            self.num_decode_steps += 1
            if out.num_prefill_tokens:  # ...and waited for prompt work in the same step
                self.num_stalled_decode_steps += 1
                self.num_stalled_prefill_tokens += out.num_prefill_tokens
        self.executor_idle_ms.append(idle_ms)
        return now, elapsed

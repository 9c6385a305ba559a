"""Batching policies, compared by the benchmarks on the same scheduler code.

A policy answers two questions each step: how many prompt tokens one
sequence may compute, and whether new requests may join now.
"""

from __future__ import annotations

from scheduler_svc.core.config import SchedulerConfig


class ChunkedPolicy:
    """Continuous batching with chunked prefill (the default): long prompts
    advance in chunks beside running decodes, so decodes never stall."""

    def prefill_cap(self, cfg: SchedulerConfig) -> int:
        cap = cfg.chunk_size
        if cfg.long_prefill_token_threshold:
            cap = min(cap, cfg.long_prefill_token_threshold)
        return cap

    def admission_open(self, num_running_at_start: int) -> bool:
        return True


class ContinuousPolicy(ChunkedPolicy):
    """Continuous batching without a chunk cap: a prompt takes as much of the
    step's budget as it needs (it still splits if longer than the budget)."""

    def prefill_cap(self, cfg: SchedulerConfig) -> int:
        return cfg.max_num_batched_tokens


class StaticPolicy(ContinuousPolicy):
    """Static batching: admit a batch only when the previous one has finished."""

    def admission_open(self, num_running_at_start: int) -> bool:
        return num_running_at_start == 0


def make_policy(cfg: SchedulerConfig) -> ChunkedPolicy:
    return {"chunked": ChunkedPolicy, "continuous": ContinuousPolicy,
            "static": StaticPolicy}[cfg.policy]()

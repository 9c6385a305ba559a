"""What a service model says about a workload: the figures every model reports, the
bounds they pass, and the lines only one model has."""

from __future__ import annotations

import dataclasses

# The bounds, one vocabulary for every model: utilization, prefill_utilization,
# decode_utilization, active_sequences, token_budget, queue_ms, ttft_ms, tpot_ms,
# kv_memory, fairness.


@dataclasses.dataclass(frozen=True)
class ClassResult:
    name: str
    tier: int
    rate_per_s: float
    queue_ms: float
    ttft_floor_ms: float
    active: float  # sequences of this class in service at once
    kv_bytes: float
    violations: tuple[str, ...] = ()  # bounds this class alone is over


@dataclasses.dataclass(frozen=True)
class Evaluation:
    utilization: float
    prefill_utilization: float
    decode_utilization: float
    chunk_tokens: int  # prompt tokens one iteration computes
    queue_ms: float  # the worst class's
    worst_ttft_ms: float
    tpot_ms: float
    worst_iteration_ms: float
    active: float
    peak_kv_bytes: float
    classes: tuple[ClassResult, ...]
    violations: tuple[str, ...]  # contract-wide bounds
    details: tuple[str, ...] = ()  # key=value lines only this model reports

    def violated(self) -> list[str]:
        out = list(self.violations)
        for c in self.classes:
            out += [f"{v} ({c.name})" for v in c.violations]
        return out

    @property
    def ok(self) -> bool:
        return not self.violated()

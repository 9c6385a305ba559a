"""What the scheduler records: one frozen dataclass per telemetry row.

These are the writer's input (``TelemetryWriter.put``) and the store's output
(``TelemetryStore.sequences`` and friends), so a record read back equals the one
written. Times are Unix seconds (floats), durations milliseconds; a field that
does not apply is None (a rejected request has no TTFT). Field names are the
column names of ``schema.TABLES``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

# SequenceRecord.status values; "rejected" rows count as rejections in reports.
SEQUENCE_STATUSES = ("finished", "aborted", "rejected", "failed")


@dataclass(frozen=True, slots=True)
class SequenceRecord:
    """One request, written once when it ends (finished, aborted, rejected or failed).

    ``queue_wait_ms`` is arrival to admission (the first step that scheduled it);
    ``ttft_ms`` arrival to first token, so ``ttft_ms - queue_wait_ms`` is time in
    prefill; ``tpot_p50_ms`` the median gap between its output tokens (None below
    two tokens). ``completed_at`` is when it ended: reports select windows by it.
    """

    request_id: str
    tenant: str
    tier: int
    model_version: str
    scheduler_version: str
    prompt_tokens: int
    output_tokens: int
    status: str
    finish_reason: str | None
    preemptions_recompute: int
    preemptions_swap: int
    queue_wait_ms: float | None
    ttft_ms: float | None
    tpot_p50_ms: float | None
    admitted_at: float | None
    completed_at: float


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One scheduler step: what it ran, what the KV pool held after it, how long it took."""

    recorded_at: float
    num_decode_tokens: int
    num_prefill_tokens: int
    num_seqs: int
    num_free_blocks: int
    num_cached_blocks: int
    step_latency_ms: float
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class ConfigRecord:
    """One version of the scheduler's config: all its values, who set it, when and why.

    ``author`` names the setter (an API key's tenant, ``cli``, ``config-file``,
    ``startup``); ``version`` increases by one per change and is the primary key.
    """

    version: int
    values: Mapping[str, object] = field(hash=False)
    author: str
    set_at: float
    reason: str

    def values_json(self) -> str:
        return json.dumps(dict(self.values), sort_keys=True)


@dataclass(frozen=True, slots=True)
class BlockTableSnapshot:
    """One sequence's block table at ``taken_at`` (an admin call takes one per running
    sequence under one ``snapshot_id``); stored one row per logical block."""

    snapshot_id: int
    taken_at: float
    request_id: str
    block_ids: tuple[int, ...]
    is_swapped: bool = False


Record = SequenceRecord | IterationRecord | ConfigRecord | BlockTableSnapshot


@dataclass(frozen=True, slots=True)
class IterationRollup:
    """Steps aggregated over one minute (``minute``: its start, Unix seconds).

    What remains of ``IterationRecord`` rows once they age out of the raw table
    (``retention.Retention.raw_iterations_s``); sums rather than means, so two
    partial rollups of the same minute merge exactly (``merged``).
    """

    minute: float
    num_steps: int
    sum_decode_tokens: int
    sum_prefill_tokens: int
    sum_num_seqs: int
    min_free_blocks: int
    sum_step_latency_ms: float
    max_step_latency_ms: float
    sum_preemptions: int

    def merged(self, other: IterationRollup) -> IterationRollup:
        assert self.minute == other.minute
        return IterationRollup(
            self.minute, self.num_steps + other.num_steps,
            self.sum_decode_tokens + other.sum_decode_tokens,
            self.sum_prefill_tokens + other.sum_prefill_tokens,
            self.sum_num_seqs + other.sum_num_seqs,
            min(self.min_free_blocks, other.min_free_blocks),
            self.sum_step_latency_ms + other.sum_step_latency_ms,
            max(self.max_step_latency_ms, other.max_step_latency_ms),
            self.sum_preemptions + other.sum_preemptions)


def roll_up(iterations: list[IterationRecord]) -> dict[float, IterationRollup]:
    """Per-minute rollups of ``iterations``, keyed by minute start."""
    out: dict[float, IterationRollup] = {}
    for it in iterations:
        minute = float(int(it.recorded_at // 60) * 60)
        one = IterationRollup(minute, 1, it.num_decode_tokens, it.num_prefill_tokens,
                              it.num_seqs, it.num_free_blocks, it.step_latency_ms,
                              it.step_latency_ms, it.num_preemptions)
        out[minute] = out[minute].merged(one) if minute in out else one
    return out

"""The scheduler process's telemetry (docs/operations.md): what it records, and when.

Records go to a ``telemetry.TelemetryWriter`` whose ``put`` never blocks (telemetry can
lose rows, never slow serving): the loop writes one per applied step (``step``), the
servicer one per request as its stream ends (``Stream``; refusals too, ``rejected``).
Times are Unix seconds, converted from the core's monotonic clock by a start offset.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from telemetry import (
    ConfigRecord,
    IterationRecord,
    SequenceRecord,
    TelemetryWriter,
)

FINISH_NAMES = {1: "stop", 2: "length", 3: "abort", 4: "error"}
SCHEDULER_VERSION = "continuum-0.1"


class Recorder:
    """Builds the scheduler's telemetry records and hands them to ``writer``."""

    def __init__(self, writer: TelemetryWriter) -> None:
        self.writer = writer
        self.model_version = ""  # the executor's model id, once one registered
        self._wall_offset = time.time() - time.monotonic()
        self._preemptions = 0

    def wall(self, monotonic_s: float) -> float:
        return monotonic_s + self._wall_offset

    def step(self, out, step_s: float, core) -> None:
        """One applied step: ``out`` its plan, ``step_s`` plan sent to answer."""
        bm = core.block_manager
        preemptions = core.num_preemptions
        self.writer.put(IterationRecord(
            time.time(), out.num_batched_tokens - out.num_prefill_tokens,
            out.num_prefill_tokens, len(out.new) + len(out.cached),
            bm.num_free_blocks if bm else 0, bm.num_cached_free_blocks if bm else 0,
            step_s * 1e3, preemptions - self._preemptions))
        self._preemptions = preemptions

    def config(self, version: int, config, author: str, reason: str) -> None:
        self.writer.put(ConfigRecord(version, dataclasses.asdict(config), author,
                                     time.time(), reason))

    def rejected(self, request_id: str, tenant: str, tier: int, prompt_tokens: int,
                 why: str) -> None:
        self.writer.put(SequenceRecord(
            request_id, tenant, tier, self.model_version, SCHEDULER_VERSION, prompt_tokens,
            0, "rejected", why[:200], 0, 0, None, None, None, None, time.time()))


class Stream:
    """One request's end, as its stream saw it, for the store."""

    @staticmethod
    def ended(recorder: Recorder, req, times: list[float], finish_reason: int | None,
              status: str) -> None:
        """``times``: monotonic send times of its tokens."""
        first = req.first_scheduled_time
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        swaps = req.num_swaps
        recorder.writer.put(SequenceRecord(
            req.request_id.split("\x1f", 1)[-1], req.tenant, req.priority_tier,
            recorder.model_version, SCHEDULER_VERSION, req.num_prompt_tokens, len(times),
            status, FINISH_NAMES.get(finish_reason or 0), req.num_preemptions - swaps, swaps,
            None if first is None else (first - req.arrival_time) * 1e3,
            (times[0] - req.arrival_time) * 1e3 if times else None,
            statistics.median(gaps) * 1e3 if gaps else None,
            None if first is None else recorder.wall(first), time.time()))

"""How long telemetry is kept, and the pass that enforces it (run by the writer).

The bound: every table that grows with traffic has a row cap, so a store's size
is at most the sum of cap × row size whatever the traffic. With the defaults:
sequences 2 M rows (~250 B with indexes: ~0.5 GB), raw iterations 1 M rows
(~100 B: ~0.1 GB), block-table snapshots 1 M rows (~60 MB), per-minute rollups
one row a minute for ``max_age_s`` (7 days: ~10 k rows), config versions one per
change (kept for ever: the audit trail) — under 1 GB in all. Rows also expire
by age: older than ``max_age_s`` they are deleted; raw iteration rows older than
``raw_iterations_s`` (or past their cap) are folded into
``scheduler_iterations_minute`` first, so the per-minute history outlives them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from telemetry.records import IterationRecord, IterationRollup, roll_up
from telemetry.store import TelemetryStore

# Raw iteration rows folded per pass: bounds one pass's memory and transaction.
_ROLLUP_BATCH = 100_000


@dataclass(frozen=True)
class Retention:
    """Retention settings; ``validate`` says what is wrong with a bad one."""

    max_age_s: float = 7 * 86400
    raw_iterations_s: float = 3600.0
    max_sequence_rows: int = 2_000_000
    max_iteration_rows: int = 1_000_000
    max_snapshot_rows: int = 1_000_000
    interval_s: float = 60.0  # how often the writer runs a pass

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"retention {f.name} must be > 0, got {getattr(self, f.name)}")
        if self.raw_iterations_s > self.max_age_s:
            raise ValueError("retention raw_iterations_s must not exceed max_age_s")


def _cap(store: TelemetryStore, table: str, id_col: str, cap: int) -> int:
    """Delete the oldest rows of ``table`` beyond its newest ``cap``; how many went."""
    rows = store.query(f"SELECT {id_col} FROM {table} ORDER BY {id_col} DESC "
                       "LIMIT 1 OFFSET ?", (cap,))
    if not rows:
        return 0
    return store.execute(f"DELETE FROM {table} WHERE {id_col} <= ?", (rows[0][0],))


def _roll_up_iterations(store: TelemetryStore, retention: Retention, now: float) -> int:
    """Fold the oldest aged-out/over-cap raw steps into per-minute rows; how many."""
    cutoff = now - retention.raw_iterations_s
    over = store.query("SELECT iteration_id FROM scheduler_iterations "
                       "ORDER BY iteration_id DESC LIMIT 1 OFFSET ?",
                       (retention.max_iteration_rows,))
    id_cut = over[0][0] if over else -1
    cond = "(recorded_at < ? OR iteration_id <= ?)"
    names = ", ".join(f.name for f in dataclasses.fields(IterationRecord))
    rows = store.query(f"SELECT iteration_id, {names} FROM scheduler_iterations "
                       f"WHERE {cond} ORDER BY iteration_id LIMIT ?",
                       (cutoff, id_cut, _ROLLUP_BATCH))
    if not rows:
        return 0
    fields = [f.name for f in dataclasses.fields(IterationRollup)]
    for minute, part in roll_up([IterationRecord(*r[1:]) for r in rows]).items():
        old = store.query(f"SELECT {', '.join(fields)} FROM scheduler_iterations_minute "
                          "WHERE minute = ?", (minute,))
        if old:
            part = IterationRollup(*old[0]).merged(part)
            store.execute("DELETE FROM scheduler_iterations_minute WHERE minute = ?",
                          (minute,))
        store.execute(f"INSERT INTO scheduler_iterations_minute ({', '.join(fields)}) "
                      f"VALUES ({', '.join('?' * len(fields))})",
                      dataclasses.astuple(part))
    # Exactly the rows read: the same condition, up to the last id read.
    store.execute(f"DELETE FROM scheduler_iterations WHERE {cond} AND iteration_id <= ?",
                  (cutoff, id_cut, rows[-1][0]))
    return len(rows)


def apply(store: TelemetryStore, retention: Retention, now: float | None = None) -> dict:
    """One retention pass in one transaction; counts of rows deleted/rolled up per table."""
    now = time.time() if now is None else now
    oldest = now - retention.max_age_s
    out = {}
    with store.transaction():
        out["scheduler_iterations_rolled_up"] = _roll_up_iterations(store, retention, now)
        for table, col in (("sequences", "completed_at"),
                           ("block_table_snapshots", "taken_at"),
                           ("scheduler_iterations", "recorded_at"),
                           ("scheduler_iterations_minute", "minute")):
            out[table] = store.execute(f"DELETE FROM {table} WHERE {col} < ?", (oldest,))
        out["sequences"] += _cap(store, "sequences", "row_id", retention.max_sequence_rows)
        out["block_table_snapshots"] += _cap(store, "block_table_snapshots", "row_id",
                                             retention.max_snapshot_rows)
    return out

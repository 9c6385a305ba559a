"""The telemetry store's tables and their versioned migrations, for SQLite and PostgreSQL.

The schema is a contract between processes (the scheduler writes, ``continuum
report``/``gate`` read), so it is defined once, here, as data: every table, column
and index carries ``since``, the schema version that introduced it. Migrating a
store from version ``v`` to ``v + 1`` creates the tables and indexes with
``since == v + 1`` and adds the columns with ``since == v + 1`` to older tables; a
fresh store is migrated from 0. Both backends get their DDL from the same
definitions (``ddl(version, backend)``), so they cannot drift apart.

Rules for a change: never edit or remove an entry, only append with the next
``since``; a column added to an existing table needs a ``default`` (old rows get
it) or ``nullable=True``. Bump ``SCHEMA_VERSION``. A server meeting a store newer
than itself refuses to write it (``store.SchemaError``) rather than guess.

Times are Unix seconds in double precision (not TIMESTAMPTZ) so both backends
store and compare the same numbers; in PostgreSQL ``to_timestamp(completed_at)``
reads them as timestamps.

Versions: 1 the first data model; 2 the fields docs/operations.md reports on, the
per-minute iteration rollup and a per-tenant index.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 2
BACKENDS = ("sqlite", "postgresql")
# The one-row table that holds the store's version.
VERSION_TABLE = "telemetry_schema"

_TYPES = {
    # kind: (sqlite, postgresql)
    "serial": ("INTEGER PRIMARY KEY", "BIGSERIAL PRIMARY KEY"),
    "int": ("INTEGER", "INTEGER"),
    "bigint": ("INTEGER", "BIGINT"),
    "float": ("REAL", "DOUBLE PRECISION"),
    "text": ("TEXT", "TEXT"),
}


@dataclass(frozen=True)
class Column:
    name: str
    kind: str
    since: int = 1
    nullable: bool = False
    default: str | None = None  # an SQL literal valid on both backends
    primary_key: bool = False

    def sql(self, backend: str) -> str:
        out = f"{self.name} {_TYPES[self.kind][BACKENDS.index(backend)]}"
        if self.primary_key:
            out += " PRIMARY KEY"
        elif not self.nullable and self.kind != "serial":
            out += " NOT NULL"
        if self.default is not None:
            out += f" DEFAULT {self.default}"
        return out


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    since: int = 1


@dataclass(frozen=True)
class Index:
    name: str
    table: str
    columns: tuple[str, ...]
    since: int = 1


def _c(name: str, kind: str, **kw) -> Column:
    return Column(name, kind, **kw)


TABLES: tuple[Table, ...] = (
    # One row per request, written when it ends (records.SequenceRecord).
    Table("sequences", (
        _c("row_id", "serial"),
        _c("request_id", "text"),
        _c("tenant", "text"),
        _c("tier", "int"),
        _c("model_version", "text"),
        _c("prompt_tokens", "int"),
        _c("output_tokens", "int"),
        _c("status", "text"),
        _c("finish_reason", "text", nullable=True),
        # Before swap existed every preemption was a recompute.
        _c("preemptions_recompute", "int"),
        _c("queue_wait_ms", "float", nullable=True),
        _c("ttft_ms", "float", nullable=True),
        _c("tpot_p50_ms", "float", nullable=True),
        _c("admitted_at", "float", nullable=True),
        _c("completed_at", "float"),
        _c("scheduler_version", "text", since=2, default="'unknown'"),
        _c("preemptions_swap", "int", since=2, default="0"),
    )),
    # One row per scheduler step (records.IterationRecord); rolled up after a while.
    Table("scheduler_iterations", (
        _c("iteration_id", "serial"),
        _c("recorded_at", "float"),
        _c("num_decode_tokens", "int"),
        _c("num_prefill_tokens", "int"),
        _c("num_seqs", "int"),
        _c("num_free_blocks", "int"),
        _c("step_latency_ms", "float"),
        _c("num_cached_blocks", "int", since=2, default="0"),
        _c("num_preemptions", "int", since=2, default="0"),
    )),
    # Every config version (records.ConfigRecord); values as sorted JSON.
    Table("scheduler_config", (
        _c("version", "int", primary_key=True),
        _c("values_json", "text"),
        _c("author", "text"),
        _c("set_at", "float"),
        _c("reason", "text"),
    )),
    # Block tables on demand (records.BlockTableSnapshot), one row per logical block.
    Table("block_table_snapshots", (
        _c("row_id", "serial"),
        _c("snapshot_id", "bigint"),
        _c("taken_at", "float"),
        _c("request_id", "text"),
        _c("logical_block_idx", "int"),
        _c("physical_block_id", "int"),
        _c("is_swapped", "int"),
    )),
    # scheduler_iterations aggregated per minute (``minute`` = bucket start, Unix s):
    # what is left of a step once its raw row ages out. Sums, so buckets merge.
    Table("scheduler_iterations_minute", (
        _c("minute", "float", primary_key=True),
        _c("num_steps", "int"),
        _c("sum_decode_tokens", "bigint"),
        _c("sum_prefill_tokens", "bigint"),
        _c("sum_num_seqs", "bigint"),
        _c("min_free_blocks", "int"),
        _c("sum_step_latency_ms", "float"),
        _c("max_step_latency_ms", "float"),
        _c("sum_preemptions", "bigint"),
    ), since=2),
)

INDEXES: tuple[Index, ...] = (
    Index("sequences_completed_at", "sequences", ("completed_at",)),
    Index("scheduler_iterations_recorded_at", "scheduler_iterations", ("recorded_at",)),
    Index("block_table_snapshots_taken_at", "block_table_snapshots", ("taken_at",)),
    Index("sequences_tenant_completed_at", "sequences", ("tenant", "completed_at"), since=2),
)


def table(name: str) -> Table:
    return next(t for t in TABLES if t.name == name)


def columns(name: str, version: int = SCHEMA_VERSION) -> tuple[str, ...]:
    """The column names ``name`` has at ``version``, in definition order."""
    return tuple(c.name for c in table(name).columns if c.since <= version)


def ddl(version: int, backend: str) -> list[str]:
    """The statements that migrate a store from ``version - 1`` to ``version``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    if not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(f"no schema version {version} (1..{SCHEMA_VERSION})")
    out = []
    for t in TABLES:
        if t.since == version:
            cols = ", ".join(c.sql(backend) for c in t.columns if c.since <= version)
            out.append(f"CREATE TABLE {t.name} ({cols})")
        elif t.since < version:
            out.extend(f"ALTER TABLE {t.name} ADD COLUMN {c.sql(backend)}"
                       for c in t.columns if c.since == version)
    out.extend(f"CREATE INDEX {i.name} ON {i.table} ({', '.join(i.columns)})"
               for i in INDEXES if i.since == version)
    return out

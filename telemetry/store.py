"""The telemetry store: SQLite (WAL) by path, PostgreSQL by ``postgresql://`` DSN.

``TelemetryStore.open(target)`` connects, and (``migrate=True``, what the server
does) brings the store up to ``schema.SCHEMA_VERSION`` in one transaction, under
a lock so two processes opening one store at once migrate it once. Readers
(``continuum report``/``gate``) open with ``migrate=False``: they never create a
store (a mistyped path is an error, not an empty report) and read an older one
as is, missing columns taking their schema default.

One store object is used by one thread at a time (the writer's, or the CLI's);
SQLite's WAL lets readers in other processes read while it writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import operator
import pathlib
import sqlite3
from collections.abc import Iterable, Iterator

from telemetry import schema
from telemetry.records import (
    BlockTableSnapshot,
    ConfigRecord,
    IterationRecord,
    IterationRollup,
    Record,
    SequenceRecord,
    roll_up,
)

# Any constant: the PostgreSQL advisory lock that serializes migrations.
_MIGRATION_LOCK = 0x17_7E1E


class StoreError(Exception):
    """The store cannot be opened or used (bad path/DSN, server down); message says which."""


class SchemaError(StoreError):
    """The store's schema version is not one this code can write (newer, or not a store)."""


def _is_dsn(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


def _redacted(dsn: str) -> str:
    """``dsn`` without its password, for messages and logs."""
    scheme, sep, rest = dsn.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return dsn
    return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"


class TelemetryStore:
    """A connection to one store; see the module docstring for who calls what."""

    def __init__(self, conn, backend: str, target: str) -> None:
        self._conn = conn
        self.backend = backend
        self._target = target
        # What messages name: the path, or the DSN without its password.
        self.target = _redacted(target) if backend == "postgresql" else target
        self.version = 0

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, target: str | pathlib.Path, *, migrate: bool = True,
             target_version: int = schema.SCHEMA_VERSION,
             busy_timeout_s: float = 30.0) -> TelemetryStore:
        """Connect to ``target`` (a file path, ``sqlite:///path`` or a PostgreSQL DSN).

        ``migrate`` creates/upgrades the store to ``target_version`` (tests pass an
        older one to build an old store). Raises StoreError / SchemaError.
        """
        text = str(target)
        if _is_dsn(text):
            store = cls(_connect_postgres(text), "postgresql", text)
        else:
            path = pathlib.Path(text.removeprefix("sqlite://"))
            if not migrate and not path.is_file():
                raise StoreError(f"no telemetry store at {path} (the server writes it; "
                                 "check --store)")
            store = cls(_connect_sqlite(path, busy_timeout_s), "sqlite", str(path))
        try:
            if migrate:
                store._migrate(target_version)
            store.version = store._read_version()
            if not migrate and store.version == 0:
                raise SchemaError(f"{store.target} is not a telemetry store "
                                  f"(no {schema.VERSION_TABLE} table)")
        except BaseException:
            store.close()
            raise
        return store

    def reconnect_if_broken(self) -> bool:
        """After a failed write: reconnect a PostgreSQL connection the server dropped
        (restart, failover, idle kill); True if it did. SQLite needs nothing."""
        if self.backend != "postgresql" or not (self._conn.closed or self._conn.broken):
            return False
        self.close()
        self._conn = _connect_postgres(self._target)
        return True

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()

    def __enter__(self) -> TelemetryStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- SQL helpers -----------------------------------------------------------------------
    def _sql(self, sql: str) -> str:
        # Statements are written with sqlite's "?"; psycopg wants "%s" (none contain a "?").
        return sql.replace("?", "%s") if self.backend == "postgresql" else sql

    def execute(self, sql: str, params: tuple = ()) -> int:
        """Run one statement; the number of rows it changed (-1 where not applicable)."""
        return self._conn.execute(self._sql(sql), params).rowcount

    def executemany(self, sql: str, rows: list[tuple]) -> None:
        if not rows:
            return
        if self.backend == "postgresql":
            with self._conn.cursor() as cur:
                cur.executemany(self._sql(sql), rows)
        else:
            self._conn.executemany(sql, rows)

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        return list(self._conn.execute(self._sql(sql), params).fetchall())

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """All-or-nothing; SQLite takes the write lock at the start (BEGIN IMMEDIATE)."""
        if self.backend == "postgresql":
            with self._conn.transaction():
                yield
            return
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # -- schema ------------------------------------------------------------------------------
    def _read_version(self) -> int:
        try:
            rows = self.query(f"SELECT version FROM {schema.VERSION_TABLE}")
        except Exception:  # no version table: a fresh file, or not ours
            if self.backend == "postgresql":
                self._conn.rollback()
            return 0
        return int(rows[0][0]) if rows else 0

    def _migrate(self, target_version: int) -> None:
        with self.transaction():
            if self.backend == "postgresql":
                self.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            self.execute(f"CREATE TABLE IF NOT EXISTS {schema.VERSION_TABLE} "
                         "(version INTEGER NOT NULL)")
            rows = self.query(f"SELECT version FROM {schema.VERSION_TABLE}")
            if not rows:
                self.execute(f"INSERT INTO {schema.VERSION_TABLE} (version) VALUES (0)")
            current = int(rows[0][0]) if rows else 0
            if current > schema.SCHEMA_VERSION:
                raise SchemaError(
                    f"telemetry store {self.target} is at schema version {current}, newer "
                    f"than this server's {schema.SCHEMA_VERSION}: upgrade the server or "
                    "point it at another store")
            for version in range(current + 1, target_version + 1):
                for stmt in schema.ddl(version, self.backend):
                    self.execute(stmt)
            if target_version > current:
                self.execute(f"UPDATE {schema.VERSION_TABLE} SET version = ?",
                             (target_version,))

    # -- writing -----------------------------------------------------------------------------
    def write(self, records: Iterable[Record]) -> None:
        """Insert ``records`` (any mix of types) in one transaction."""
        if self.version != schema.SCHEMA_VERSION:
            raise SchemaError(f"store is at version {self.version}; open it with migrate=True "
                              "to write")
        groups: dict[type, list] = {}
        for r in records:
            groups.setdefault(type(r), []).append(r)
        with self.transaction():
            for kind, items in groups.items():
                self._insert(kind, items)

    def _insert(self, kind: type, items: list) -> None:
        if kind is ConfigRecord:
            rows = [(r.version, r.values_json(), r.author, r.set_at, r.reason) for r in items]
            self.executemany("INSERT INTO scheduler_config (version, values_json, author, "
                             "set_at, reason) VALUES (?, ?, ?, ?, ?)", rows)
            return
        if kind is BlockTableSnapshot:
            rows = [(r.snapshot_id, r.taken_at, r.request_id, i, b, int(r.is_swapped))
                    for r in items for i, b in enumerate(r.block_ids)]
            self.executemany("INSERT INTO block_table_snapshots (snapshot_id, taken_at, "
                             "request_id, logical_block_idx, physical_block_id, is_swapped) "
                             "VALUES (?, ?, ?, ?, ?, ?)", rows)
            return
        table = {SequenceRecord: "sequences", IterationRecord: "scheduler_iterations"}[kind]
        names = [f.name for f in dataclasses.fields(kind)]
        marks = ", ".join("?" * len(names))
        # attrgetter, not dataclasses.astuple (a recursive deep copy): the writer thread
        # shares the GIL with the step loop, so its Python work per row is kept small.
        row = operator.attrgetter(*names)
        self.executemany(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({marks})",
                         [row(r) for r in items])

    # -- reading -----------------------------------------------------------------------------
    def _select(self, kind: type, table: str, where: str, params: tuple, order: str) -> list:
        """Rows of ``table`` as ``kind`` records; columns newer than the store get defaults."""
        present = set(schema.columns(table, self.version))
        exprs = []
        for f in dataclasses.fields(kind):
            col = next(c for c in schema.table(table).columns if c.name == f.name)
            exprs.append(f.name if f.name in present else (col.default or "NULL"))
        rows = self.query(f"SELECT {', '.join(exprs)} FROM {table} WHERE {where} "
                          f"ORDER BY {order}", params)
        return [kind(*row) for row in rows]

    def sequences(self, since: float, until: float, tenant: str | None = None,
                  tier: int | None = None) -> list[SequenceRecord]:
        """Requests that ended in [since, until), oldest first, optionally one tenant/tier."""
        where, params = "completed_at >= ? AND completed_at < ?", [since, until]
        if tenant is not None:
            where, params = where + " AND tenant = ?", [*params, tenant]
        if tier is not None:
            where, params = where + " AND tier = ?", [*params, tier]
        return self._select(SequenceRecord, "sequences", where, tuple(params),
                            "completed_at, row_id")

    def iterations(self, since: float, until: float) -> list[IterationRecord]:
        """Raw step rows recorded in [since, until) (older ones live only as rollups)."""
        return self._select(IterationRecord, "scheduler_iterations",
                            "recorded_at >= ? AND recorded_at < ?", (since, until),
                            "recorded_at, iteration_id")

    def iteration_minutes(self, since: float, until: float) -> list[IterationRollup]:
        """Per-minute step aggregates over [since, until): raw rows and rollups merged."""
        merged = roll_up(self.iterations(since, until))
        if self.version >= 2:
            fields = ", ".join(f.name for f in dataclasses.fields(IterationRollup))
            for row in self.query(f"SELECT {fields} FROM scheduler_iterations_minute "
                                  "WHERE minute >= ? AND minute < ?", (since, until)):
                r = IterationRollup(*row)
                merged[r.minute] = merged[r.minute].merged(r) if r.minute in merged else r
        return [merged[m] for m in sorted(merged)]

    def config_history(self) -> list[ConfigRecord]:
        rows = self.query("SELECT version, values_json, author, set_at, reason "
                          "FROM scheduler_config ORDER BY version")
        return [ConfigRecord(v, json.loads(j), a, t, why) for v, j, a, t, why in rows]

    def block_snapshot(self, snapshot_id: int) -> list[BlockTableSnapshot]:
        rows = self.query("SELECT taken_at, request_id, physical_block_id, is_swapped FROM "
                          "block_table_snapshots WHERE snapshot_id = ? "
                          "ORDER BY request_id, logical_block_idx", (snapshot_id,))
        tables: dict[str, tuple[float, list[int], bool]] = {}
        for taken_at, request_id, block, swapped in rows:
            tables.setdefault(request_id, (taken_at, [], bool(swapped)))[1].append(block)
        return [BlockTableSnapshot(snapshot_id, t, rid, tuple(blocks), sw)
                for rid, (t, blocks, sw) in tables.items()]

    def count(self, table: str) -> int:
        assert table in {t.name for t in schema.TABLES}, table
        return int(self.query(f"SELECT COUNT(*) FROM {table}")[0][0])


def _connect_sqlite(path: pathlib.Path, busy_timeout_s: float):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves (DDL included);
        # check_same_thread=False: the writer opens it, then only its thread uses it.
        conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None,
                               check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a power cut may lose the last commits, never corrupt the file.
        conn.execute("PRAGMA synchronous=NORMAL")
    except (OSError, sqlite3.Error) as exc:
        raise StoreError(f"cannot open telemetry store {path}: {exc}") from exc
    return conn


def _connect_postgres(dsn: str):
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - a dependency in pyproject
        raise StoreError("a postgresql:// store needs psycopg 3 (pip install "
                         "'psycopg[binary]')") from exc
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.Error as exc:
        # The DSN may hold a password: name the server, not the DSN.
        # One line: libpq's message spans several.
        raise StoreError("cannot connect to the PostgreSQL telemetry store: "
                         + " ".join(str(exc).split())) from exc

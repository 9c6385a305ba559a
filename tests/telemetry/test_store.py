"""The store on both backends: round trips, migrations, and refusing what it cannot read."""

from __future__ import annotations

import pytest

from telemetry import (
    BlockTableSnapshot,
    ConfigRecord,
    IterationRecord,
    SchemaError,
    SequenceRecord,
    StoreError,
    TelemetryStore,
    schema,
)


def seq(i: int, tenant: str = "acme", tier: int = 1, t: float = 1000.0, **kw) -> SequenceRecord:
    values = dict(request_id=f"r{i}", tenant=tenant, tier=tier, model_version="smol-135m",
                  scheduler_version="0.1.0", prompt_tokens=10 + i, output_tokens=20,
                  status="finished", finish_reason="stop", preemptions_recompute=0,
                  preemptions_swap=0, queue_wait_ms=1.0 * i, ttft_ms=2.0 * i,
                  tpot_p50_ms=3.0, admitted_at=t - 1, completed_at=t + i)
    values.update(kw)
    return SequenceRecord(**values)


def step(t: float, latency: float = 10.0, **kw) -> IterationRecord:
    values = dict(recorded_at=t, num_decode_tokens=8, num_prefill_tokens=64, num_seqs=9,
                  num_free_blocks=100, num_cached_blocks=4, step_latency_ms=latency,
                  num_preemptions=0)
    values.update(kw)
    return IterationRecord(**values)


def test_every_record_type_reads_back_equal(store):
    records = [seq(1), seq(2, tenant="zeta", tier=0, ttft_ms=None, tpot_p50_ms=None,
                           status="rejected", finish_reason=None, admitted_at=None)]
    steps = [step(1000.0 + i) for i in range(3)]
    config = ConfigRecord(1, {"max_num_seqs": 64, "chunk_size": 512}, "cli", 999.0, "startup")
    snap = [BlockTableSnapshot(7, 1001.0, "r1", (5, 2, 9)),
            BlockTableSnapshot(7, 1001.0, "r2", (1,), is_swapped=True)]
    store.write([*records, *steps, config, *snap])
    assert store.sequences(0, 2000) == records
    assert store.sequences(0, 2000, tenant="zeta") == records[1:]
    assert store.sequences(0, 2000, tier=1) == records[:1]
    assert store.sequences(1002, 2000) == records[1:]  # [since, until): r1 ended at 1001
    assert store.iterations(0, 2000) == steps
    assert store.config_history() == [config]
    assert store.block_snapshot(7) == snap
    minutes = store.iteration_minutes(0, 2000)
    assert [m.num_steps for m in minutes] == [3]
    assert minutes[0].sum_prefill_tokens == 3 * 64


def test_an_older_store_is_migrated_and_keeps_its_rows(store_target):
    """A version-1 store (the first schema's columns) opened by this server becomes version 2."""
    with TelemetryStore.open(store_target, target_version=1) as old:
        assert old.version == 1
        old.execute("INSERT INTO sequences (request_id, tenant, tier, model_version, "
                    "prompt_tokens, output_tokens, status, finish_reason, "
                    "preemptions_recompute, queue_wait_ms, ttft_ms, tpot_p50_ms, admitted_at, "
                    "completed_at) VALUES ('old', 'acme', 2, 'm', 5, 6, 'finished', 'length', "
                    "1, 4.0, 5.0, 6.0, 10.0, 11.0)")
        old.execute("INSERT INTO scheduler_iterations (recorded_at, num_decode_tokens, "
                    "num_prefill_tokens, num_seqs, num_free_blocks, step_latency_ms) "
                    "VALUES (12.0, 1, 2, 3, 4, 5.0)")
    # A reader reads the old store as is: missing columns take their defaults.
    with TelemetryStore.open(store_target, migrate=False) as reader:
        assert reader.version == 1
        (row,) = reader.sequences(0, 100)
        assert (row.scheduler_version, row.preemptions_swap, row.preemptions_recompute) == (
            "unknown", 0, 1)
        with pytest.raises(SchemaError, match="migrate=True"):
            reader.write([seq(1)])
    with TelemetryStore.open(store_target) as new:
        assert new.version == schema.SCHEMA_VERSION
        (row,) = new.sequences(0, 100)
        assert row.request_id == "old" and row.scheduler_version == "unknown"
        assert new.iterations(0, 100)[0].num_cached_blocks == 0
        new.write([seq(1, t=20.0), step(30.0, num_preemptions=2)])
        assert len(new.sequences(0, 100)) == 2
        assert new.iterations(0, 100)[1].num_preemptions == 2
    # Opening again is a no-op (no duplicate DDL).
    with TelemetryStore.open(store_target) as again:
        assert again.version == schema.SCHEMA_VERSION


def test_a_newer_store_is_refused_not_guessed(store_target):
    with TelemetryStore.open(store_target) as s:
        s.execute(f"UPDATE {schema.VERSION_TABLE} SET version = ?", (schema.SCHEMA_VERSION + 1,))
    with pytest.raises(SchemaError, match="newer than this server"):
        TelemetryStore.open(store_target)


def test_readers_never_create_a_store(tmp_path):
    missing = tmp_path / "typo.db"
    with pytest.raises(StoreError, match="no telemetry store"):
        TelemetryStore.open(missing, migrate=False)
    assert not missing.exists()
    other = tmp_path / "other.db"
    import sqlite3

    sqlite3.connect(other).execute("CREATE TABLE x (y INTEGER)")
    with pytest.raises(SchemaError, match="not a telemetry store"):
        TelemetryStore.open(other, migrate=False)


def test_messages_never_show_a_dsn_password(pg_cluster):
    from tests.telemetry.conftest import fresh_pg_database

    prefix = fresh_pg_database(pg_cluster)
    dsn = prefix.replace("postgres@", "postgres:hunter2@")  # trust auth ignores it
    with pytest.raises(SchemaError, match="not a telemetry store") as info:
        TelemetryStore.open(dsn, migrate=False)
    assert "hunter2" not in str(info.value) and "postgres:***@" in str(info.value)


def test_an_unreachable_postgres_is_one_clear_error():
    with pytest.raises(StoreError, match="cannot connect") as info:
        TelemetryStore.open("postgresql://u:secretpw@127.0.0.1:1/x")
    assert "secretpw" not in str(info.value) and "\n" not in str(info.value)


def test_sqlite_store_is_in_wal_mode(tmp_path):
    with TelemetryStore.open(tmp_path / "t.db") as s:
        assert s.query("PRAGMA journal_mode")[0][0] == "wal"


def test_both_backends_get_ddl_from_one_definition():
    for version in range(1, schema.SCHEMA_VERSION + 1):
        lite, pg = schema.ddl(version, "sqlite"), schema.ddl(version, "postgresql")
        assert len(lite) == len(pg)
        assert [s.split("(")[0] for s in lite] == [s.split("(")[0] for s in pg]

"""The writer never blocks its caller and counts what it drops; retention bounds the store."""

from __future__ import annotations

import contextlib
import threading
import time

from telemetry import (
    Retention,
    TelemetryStore,
    TelemetryWriter,
    retention,
)
from tests.telemetry.test_store import seq, step


@contextlib.contextmanager
def store_write_locked(target: str):
    """Another client holds the write lock on ``scheduler_iterations`` (a store that
    stalls: a long checkpoint, a lock, a slow disk) until the block exits."""
    with TelemetryStore.open(target) as other, other.transaction():
        # SQLite's transaction() takes the database's write lock (BEGIN IMMEDIATE).
        if other.backend == "postgresql":
            other.execute("LOCK TABLE scheduler_iterations IN ACCESS EXCLUSIVE MODE")
        yield


def test_a_stalled_store_drops_and_counts_but_never_blocks_put(store_target):
    cap, batch, n = 50, 10, 500
    t0 = time.time()  # recent: the writer's retention pass must not expire these rows
    writer = TelemetryWriter.open(store_target, max_queue=cap, batch_size=batch, poll_s=0.05)
    try:
        with store_write_locked(store_target):
            writer.put(step(t0))  # the thread takes it and stalls on the lock
            results = []
            done = threading.Event()

            def produce():  # the step loop: if put blocked, this would never finish
                results.extend(writer.put(step(t0 + i)) for i in range(n))
                done.set()

            threading.Thread(target=produce, daemon=True).start()
            assert done.wait(60), "put() blocked while the store was stalled"
            # The queue holds at most `cap`; the thread holds at most one batch.
            assert writer.num_dropped == results.count(False)
            assert writer.num_dropped >= n - cap - batch
            assert writer.num_accepted == 1 + results.count(True)
            assert writer.num_written == 0
        assert writer.flush(60)
        assert writer.num_written == writer.num_accepted
        assert writer.num_failed == 0
    finally:
        writer.close()
    with TelemetryStore.open(store_target, migrate=False) as s:
        assert s.count("scheduler_iterations") == writer.num_accepted


def test_a_refused_batch_is_counted_and_the_writer_goes_on(store_target):
    writer = TelemetryWriter.open(store_target, poll_s=0.05)
    try:
        t0 = time.time()
        bad = seq(1, tenant=None, t=t0)  # NOT NULL: the store refuses the batch
        assert writer.put(bad)
        assert writer.flush(30)
        assert writer.num_failed == 1
        assert writer.put(seq(2, t=t0))
        assert writer.flush(30)
        assert writer.num_written == 1
    finally:
        writer.close()


def test_retention_expires_old_rows_and_rolls_up_steps(store):
    now = 10 * 86400.0
    keep = Retention(max_age_s=86400, raw_iterations_s=600, max_sequence_rows=1000,
                     max_iteration_rows=1000)
    store.write([seq(i, t=now - 2 * 86400) for i in range(5)]  # past max_age
                + [seq(10 + i, t=now - 60) for i in range(3)]
                + [step(now - 3600 + i, latency=float(i)) for i in range(120)]  # roll up
                + [step(now - 10 + i * 0.1) for i in range(50)]  # stay raw
                + [step(now - 2 * 86400)])  # rolled up, then the rollup expires
    before = store.iteration_minutes(now - 86400, now + 1)
    out = retention.apply(store, keep, now)
    assert out["sequences"] == 5
    assert out["scheduler_iterations_rolled_up"] == 121
    assert [r.request_id for r in store.sequences(0, now + 10)] == ["r10", "r11", "r12"]
    assert store.count("scheduler_iterations") == 50
    # The per-minute view of the kept window is unchanged by rolling up.
    assert store.iteration_minutes(now - 86400, now + 1) == before
    assert store.iteration_minutes(0, now - 86400) == []
    again = retention.apply(store, keep, now)
    assert again["sequences"] == 0 and again["scheduler_iterations_rolled_up"] == 0


def test_row_caps_bound_the_store_whatever_the_traffic(store):
    now = 5000.0
    keep = Retention(max_sequence_rows=10, max_iteration_rows=20, max_snapshot_rows=5)
    store.write([seq(i, t=now) for i in range(30)] + [step(now + i * 0.01) for i in range(60)])
    retention.apply(store, keep, now + 1)
    assert [r.request_id for r in store.sequences(0, now + 100)] == [
        f"r{i}" for i in range(20, 30)]  # the newest ten
    assert store.count("scheduler_iterations") == 20
    assert sum(m.num_steps for m in store.iteration_minutes(0, now + 100)) == 60


def test_bad_retention_settings_are_refused():
    import pytest

    with pytest.raises(ValueError, match="max_age_s"):
        Retention(max_age_s=0).validate()
    with pytest.raises(ValueError, match="raw_iterations_s"):
        Retention(max_age_s=10, raw_iterations_s=20).validate()


def test_the_writer_survives_postgres_dropping_its_connection(pg_cluster):
    """The server kills the writer's session (a restart, a failover): the batch in flight
    is counted as failed, the writer reconnects, and later records land."""
    import psycopg

    from tests.telemetry.conftest import fresh_pg_database

    target = fresh_pg_database(pg_cluster)
    writer = TelemetryWriter.open(target, poll_s=0.05)
    try:
        t0 = time.time()
        assert writer.put(seq(1, t=t0)) and writer.flush(30)
        with psycopg.connect(target, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        for i in range(2, 30):  # until one lands after the reconnect
            assert writer.put(seq(i, t=t0)) and writer.flush(30)
            if writer.num_failed and writer.num_written > 1:
                break
        assert writer.num_failed >= 1 and writer.num_written >= 2
    finally:
        writer.close()
    with TelemetryStore.open(target, migrate=False) as s:
        assert s.count("sequences") == writer.num_written

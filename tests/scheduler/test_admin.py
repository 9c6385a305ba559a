"""The scheduler's admin service (the live config reload) through a real process.

One ``python -m scheduler_svc`` (no executor) with a ``--config-file`` and a SQLite
telemetry store; the tests talk to it with grpc stubs and with ``continuum config``
run in-process (the real CLI code against the real server). They share the process,
so each reads the version it starts from rather than assuming one.
"""

from __future__ import annotations

import json
import subprocess
import time

import grpc
import pytest

from continuum import cli
from protos.continuum.v1 import scheduler_pb2 as pb
from protos.continuum.v1 import scheduler_pb2_grpc
from telemetry import TelemetryStore
from tests.conftest import TEST_METADATA
from tests.scheduler.scheduler_process import free_port, scheduler_cmd, wait_serving

pytestmark = pytest.mark.spawns  # starts service processes (tests/tiers.py)

WAIT_S = 30.0  # generous: the file is polled every 2 s, the store written within 0.1 s


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    """(address, config file path, telemetry store path, log path) of a running scheduler."""
    tmp = tmp_path_factory.mktemp("admin")
    conf, store, log = tmp / "scheduler.toml", tmp / "telemetry.sqlite", tmp / "stderr.log"
    conf.write_text("max_num_seqs = 32\n")
    port = free_port()
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [*scheduler_cmd(tmp, port), "--max-num-seqs", "48", "--config-file", str(conf),
             "--telemetry-dsn", str(store)],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    try:
        wait_serving(port, proc)
        yield f"127.0.0.1:{port}", conf, store, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def admin(sched):
    with grpc.insecure_channel(sched[0]) as channel:
        yield scheduler_pb2_grpc.SchedulerAdminStub(channel)


def call(method, request):
    return method(request, timeout=10, metadata=TEST_METADATA)


def current(admin) -> pb.ConfigVersion:
    return call(admin.GetConfig, pb.GetConfigRequest())


def wait_version(admin, above: int) -> pb.ConfigVersion:
    deadline = time.monotonic() + WAIT_S
    while (v := current(admin)).version <= above:
        assert time.monotonic() < deadline, f"the config stayed at version {v.version}"
        time.sleep(0.2)
    return v


def test_startup_config_is_version_1_with_the_file_over_the_flags(admin):
    first = call(admin.ConfigHistory, pb.ConfigHistoryRequest()).versions[0]
    assert first.version == 1 and first.author == "startup"
    assert first.values["max_num_seqs"] == "32"  # the file wins over --max-num-seqs 48
    assert "scheduler.toml" in first.reason


def test_set_get_history_rollback_round_trip(admin):
    start = current(admin)
    v = call(admin.SetConfig, pb.SetConfigRequest(
        values={"max_num_seqs": "7", "chunk_size": "256"}, author="alice", reason="peak"))
    assert v.version == start.version + 1
    assert (v.values["max_num_seqs"], v.values["chunk_size"]) == ("7", "256")
    assert current(admin) == v
    history = call(admin.ConfigHistory, pb.ConfigHistoryRequest()).versions
    assert [h.version for h in history] == list(range(1, v.version + 1))
    assert (history[-1].author, history[-1].reason) == ("alice", "peak")
    assert history[-1].set_at >= history[-2].set_at
    back = call(admin.Rollback, pb.RollbackRequest(version=start.version, author="bob"))
    assert back.version == v.version + 1 and back.reason == f"rollback to {start.version}"
    assert back.values == start.values
    again = call(admin.SetConfig, pb.SetConfigRequest(values=dict(start.values), author="x"))
    assert again.version == back.version, "a change that changes nothing is no new version"


@pytest.mark.parametrize("values, code, says", [
    ({"max_num_seqs": "0"}, grpc.StatusCode.INVALID_ARGUMENT, "max_num_seqs must be a positive"),
    ({"max_num_seqs": "lots"}, grpc.StatusCode.INVALID_ARGUMENT, "must be an integer"),
    ({"chunk_size": "4096"}, grpc.StatusCode.INVALID_ARGUMENT, "chunk_size (4096) must be <="),
    ({"policy": "fifo"}, grpc.StatusCode.INVALID_ARGUMENT, "policy must be one of"),
    ({"aging_s": "nan"}, grpc.StatusCode.INVALID_ARGUMENT, "aging_s must be a finite number"),
    ({"async_scheduling": "maybe"}, grpc.StatusCode.INVALID_ARGUMENT, "must be true or false"),
    ({"max_num_sequences": "8"}, grpc.StatusCode.INVALID_ARGUMENT, "unknown config field"),
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "nothing to set"),
    ({"enable_prefix_caching": "false"}, grpc.StatusCode.FAILED_PRECONDITION,
     "cannot change while the scheduler runs"),
    ({"max_num_batched_tokens": "4096"}, grpc.StatusCode.FAILED_PRECONDITION,
     "cannot rise above its startup value 2048"),
])
def test_a_bad_value_is_refused_with_its_reason_and_changes_nothing(admin, values, code,
                                                                     says):
    before = current(admin)
    with pytest.raises(grpc.RpcError) as err:
        call(admin.SetConfig, pb.SetConfigRequest(values=values, author="cli"))
    assert err.value.code() == code and says in err.value.details()
    assert current(admin) == before


def test_author_is_required_and_unknown_versions_are_not_found(admin):
    with pytest.raises(grpc.RpcError) as err:
        call(admin.SetConfig, pb.SetConfigRequest(values={"max_num_seqs": "9"}, author=" "))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "author is required" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        call(admin.Rollback, pb.RollbackRequest(version=999, author="cli"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("metadata", [(), (("x-continuum-internal-auth", "wrong"),)])
def test_calls_without_the_secret_are_refused(admin, metadata):
    before = current(admin)
    for method, request in ((admin.GetConfig, pb.GetConfigRequest()),
                            (admin.SetConfig, pb.SetConfigRequest(
                                values={"max_num_seqs": "3"}, author="mallory")),
                            (admin.SnapshotBlockTables, pb.SnapshotBlockTablesRequest())):
        with pytest.raises(grpc.RpcError) as err:
            method(request, timeout=10, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert current(admin) == before


def test_the_config_file_is_applied_on_change_and_a_bad_one_changes_nothing(admin, sched):
    _, conf, _, log = sched
    start = current(admin)
    conf.write_text('max_num_seqs = 12\npolicy = "continuous"\n')
    v = wait_version(admin, start.version)
    assert (v.author, v.values["max_num_seqs"], v.values["policy"]) == (
        "config-file", "12", "continuous")
    conf.write_text("max_num_seqs = -1\n")  # refused (logged); then a good one again
    deadline = time.monotonic() + WAIT_S
    while "max_num_seqs must be a positive integer, got -1" not in log.read_text():
        assert time.monotonic() < deadline, "the bad config file was not refused in the log"
        time.sleep(0.2)
    assert current(admin) == v
    conf.write_text("max_num_seqs = 13\n")
    after = wait_version(admin, v.version)
    assert after.version == v.version + 1, "the bad file must not have made a version"
    # Fields the file no longer names are back at their command-line values.
    assert (after.values["max_num_seqs"], after.values["policy"]) == ("13", "chunked")


def test_versions_are_written_to_the_telemetry_store(admin, sched):
    latest = current(admin).version
    rows = store_versions(sched[2], latest)
    history = call(admin.ConfigHistory, pb.ConfigHistoryRequest()).versions
    assert [(r.version, r.author, r.reason) for r in rows] == [
        (h.version, h.author, h.reason) for h in history[:len(rows)]]
    assert rows[-1].version >= latest and rows[0].author == "startup"


def store_versions(path, at_least: int) -> list:
    """The store's config rows once it holds version ``at_least`` (the writer lingers)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        with TelemetryStore.open(path, migrate=False) as store:
            rows = store.config_history()
        if rows and rows[-1].version >= at_least or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_a_restarted_scheduler_numbers_its_versions_after_the_store(sched, tmp_path):
    with grpc.insecure_channel(sched[0]) as ch:
        latest = current(scheduler_pb2_grpc.SchedulerAdminStub(ch)).version
    store_versions(sched[2], latest)
    port = free_port()
    proc = subprocess.Popen([*scheduler_cmd(tmp_path, port), "--telemetry-dsn", str(sched[2])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(port, proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            first = current(scheduler_pb2_grpc.SchedulerAdminStub(ch))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert first.version == latest + 1 and first.author == "startup"
    rows = store_versions(sched[2], first.version)
    assert rows[-1].version == first.version, "the restart's version 1 must not collide"


def test_block_table_snapshot_without_an_executor_is_empty(admin):
    snap = call(admin.SnapshotBlockTables, pb.SnapshotBlockTablesRequest())
    assert snap.snapshot_id > 0 and snap.taken_at > 0
    assert list(snap.tables) == [] and snap.num_total_blocks == 0


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        cli.main(["config", *argv])
    out, err = capsys.readouterr()
    return done.value.code, out, err


def test_cli_exit_codes_and_output(sched, capsys):
    addr = ["--scheduler", sched[0]]
    code, out, _ = run_cli(capsys, "set", "max_num_waiting=500", "--reason", "cli test", *addr)
    assert code == 0 and "max_num_waiting=500" in out
    code, out, _ = run_cli(capsys, "get", "--format", "json", *addr)
    got = json.loads(out)
    assert code == 0 and got["values"]["max_num_waiting"] == "500" and got["author"] == "cli"
    code, out, _ = run_cli(capsys, "history", *addr)
    assert code == 0 and "max_num_waiting 1024->500" in out and "cli test" in out
    code, _, err = run_cli(capsys, "set", "max_num_waiting=-5", *addr)
    assert code == 1 and "max_num_waiting must be a positive integer" in err
    code, _, err = run_cli(capsys, "rollback", "999", *addr)
    assert code == 1 and "no config version 999" in err
    code, out, _ = run_cli(capsys, "snapshot-blocks", "--format", "json", *addr)
    assert code == 0 and json.loads(out)["tables"] == []
    code, _, err = run_cli(capsys, "set", "max_num_waiting", *addr)
    assert code == 2 and "FIELD=VALUE" in err
    code, _, err = run_cli(capsys, "get", "--scheduler", f"127.0.0.1:{free_port()}",
                           "--timeout", "3")
    assert code == 2 and "did not answer" in err

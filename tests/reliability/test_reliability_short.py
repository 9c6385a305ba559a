"""The CI form of ``make reliability``: every row at its smallest, on one real server.

Asserts what must hold on any machine, never how fast: no server errors, no lost
stream, no duplicated or diverged token after an executor kill, a clean idle state
after the soak (no running/waiting request, every block free, no executor sequence
state, no fd growth), no fuzz input that gets a 5xx / INTERNAL / hang or kills a
process, and greedy streams that the schema fuzzer's inputs leave token for token
unchanged. Figures that depend on the machine or on work still landing (refusal
fractions, TTFT, the ITL ratio, RSS) are printed in the table, not asserted.
"""

from __future__ import annotations

import pytest

from benchmarks.reliability import burst, chaos, fuzz, fuzz_schema, overload, report, soak
from harness import servers
from tests.tiers import spawns_processes

pytestmark = pytest.mark.integration

CI = "ci"


@pytest.fixture(scope="module")
@spawns_processes
def serve(tmp_path_factory):
    srv = servers.start_serve(tmp_path_factory.mktemp("reliability"))
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def table():
    rows: list[dict] = []
    yield rows
    print("\n" + report.markdown(rows, "CI"))


def test_overload_answers_every_request_without_server_errors(serve, table):
    row = overload.run(serve, CI)
    table.append(row)
    assert row["server_errors"] == 0, row["errors_seen"]
    assert row["idle_after"], "requests were left running or waiting after the overload"
    assert row["refused_with_retry_hint"] == row["refused"], "a refusal without a retry hint"


def test_a_burst_is_answered_every_one_with_an_http_status(serve, table):
    """From one address: a connection each, through a pool, and beside idle connections."""
    rows = burst.run(serve, CI)
    table.extend(rows)
    for row in rows:
        assert row["no_http_answer"] == 0 and row["other"] == 0, row
        assert row["served"] > 0 and row["idle_after"], row


def test_soak_leaves_a_clean_idle_state(serve, table):
    row = soak.run(serve, CI)
    table.append(row)
    assert row["server_errors"] == 0, row["errors_seen"]
    assert row["lost"] == 0
    assert row["idle_clean_1"] and row["idle_clean_2"], row
    assert row["fds_ok"], row["fd_growth"]


def test_executor_kill_during_decode_loses_and_duplicates_nothing(serve, table):
    [row] = chaos.run_serve(serve, CI)
    table.append(row)
    assert row["phase_hit"], "the streams never all reached decode"
    assert (row["lost"], row["duplicated"], row["diverged"], row["errored"]) == (0, 0, 0, 0), row
    assert row["identical"] == row["streams"]


def test_schema_fuzzing_of_every_field_leaves_normal_streams_and_the_server_intact(
        serve, table):
    """One input per field of both APIs (their schemas' every key and field path), the
    first at its edge, while greedy streams run; the reproducers say what broke."""
    row = fuzz_schema.run(serve, CI)
    table.append(row)
    assert row["server_errors"] == 0 and row["failures"] == 0, row["reproducers"]
    assert row["slow"] == row["echoes"] == 0, row["reproducers"]
    assert row["streams_identical"], (row["stream_mismatches"], row["stream_error"])
    assert row["health_status"] == 200 and row["normal_request_ok"], row
    assert all(row["processes_kept"].values()), row["processes_kept"]
    assert row["examples"] >= sum(row["fields"].values()), "a field went unprobed"


def test_fuzzing_finds_no_server_error(serve, table, tmp_path):
    row = fuzz.run(serve, tmp_path, CI)
    table.append(row)
    assert row["failures"] == 0, row["reproducers"]
    assert row["processes_survived"]

"""A warm standby executor (``continuum serve --standby-executors 1``) on the real server:
kill -9 and SIGSTOP of the executor in service hand the streams to the standby (no
process start, no model load), both dying at once is survived by a new process; every
time clients see a pause, never an error, and seeded and greedy outputs equal a run
without the fault (no token lost or duplicated)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time

import pytest

from protos.continuum.v1 import sampling_pb2
from tests.integration.conftest import start_server
from tests.integration.test_faults import rings_attached
from tests.integration.test_serve import chat, collect, wait_until_idle

pytestmark = pytest.mark.integration

NUM_STREAMS = 4
MAX_TOKENS = 16
READY_S = 240.0


def requests():
    return [chat(f"Write a line about the number {i}.", max_tokens=MAX_TOKENS, ignore_eos=True,
                 **({"temperature": 0.9, "seed": 7 + i} if i % 2 else {}))
            for i in range(NUM_STREAMS)]


def executors(server, standby: bool = True) -> tuple[int, int]:
    """(executor pid, standby pid) once one serves and, if asked, a standby is registered."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats.executor_pid and (stats.standby_executor_pid or not standby):
            return stats.executor_pid, stats.standby_executor_pid
        time.sleep(0.1)
    raise AssertionError("no executor and standby registered:\n"
                         + "".join(server.log[-30:]))


def run_all(server, fault=None) -> list[list[int]]:
    """Streams every request; ``fault()`` runs once the server has stepped a few times."""
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(collect, server, r) for r in requests()]
        if fault is not None:
            steps = server.stats().num_steps
            deadline = time.monotonic() + 120
            while server.stats().num_steps < steps + 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            fault()
        results = [f.result() for f in futures]
    for responses in results:
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == MAX_TOKENS
    return [[t for r in responses for t in r.token_ids] for responses in results]


@pytest.fixture(scope="module")
def standby_server(tmp_path_factory, model_dir):
    srv = start_server(tmp_path_factory.mktemp("standby"), model_dir,
                       "--kv-cache-bytes", str(48 << 20), "--standby-executors", "1",
                       "--max-queue-time-standard-s", "0", "--threads", "1",
                       "--plan-channel", "shm")
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def baseline(standby_server):
    return run_all(standby_server)


def test_kill_9_hands_the_streams_to_the_standby(standby_server, baseline):
    srv = standby_server
    active, standby = executors(srv)
    takeovers = srv.stats().num_standby_takeovers
    rings = rings_attached(srv)
    assert rings >= 1, "the plans must go through the shared-memory ring"
    assert run_all(srv, lambda: os.kill(active, signal.SIGKILL)) == baseline
    assert rings_attached(srv, rings) > rings  # the standby got a fresh ring
    stats = srv.stats()  # (a busy box may see a step miss its deadline too: "at least")
    assert stats.executor_pid != active and stats.num_standby_takeovers >= takeovers + 1
    assert any(f'"pid": {standby}' in line and "standby executor takes over" in line
               for line in srv.log)
    assert wait_until_idle(srv).num_free_blocks == stats.num_total_blocks


def test_a_hung_executor_is_replaced_by_the_standby(standby_server, baseline):
    srv = standby_server
    hung, standby = executors(srv)  # the supervisor has started a new standby by now
    try:
        tokens = run_all(srv, lambda: os.kill(hung, signal.SIGSTOP))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
    assert tokens == baseline
    stats = srv.stats()
    assert stats.executor_pid != hung and stats.num_standby_takeovers >= 2
    assert any("executor missed its step deadline" in line for line in srv.log)


def test_both_dying_is_survived_by_a_new_executor_and_standby(standby_server, baseline):
    srv = standby_server
    active, standby = executors(srv)

    def kill_both():
        os.kill(standby, signal.SIGKILL)
        os.kill(active, signal.SIGKILL)

    assert run_all(srv, kill_both) == baseline
    # Served by a process that is neither (started cold, or a standby started after the
    # first death was seen), and a warm standby again, also neither, once one has loaded.
    serving, warm = executors(srv)
    assert serving not in (active, standby) and warm not in (active, standby, serving)
    assert wait_until_idle(srv).num_free_blocks == srv.stats().num_total_blocks

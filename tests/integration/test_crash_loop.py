"""serve's crash-loop guard on the real server: the death past ``--max-executor-restarts``
within ``--restart-window-s`` stops the whole server with a line naming the flag, a
standby takeover spends the budget like a cold restart, and the harness turns the
refused call that follows into one message naming the guard (``Serve.why_stopped``)."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from tests.integration.conftest import start_server

pytestmark = pytest.mark.integration

READY_S = 240.0


def executor_pids(server, standby: bool = False, not_pid: int = 0) -> tuple[int, int]:
    """(executor, standby) pids once an executor other than ``not_pid`` serves (and a
    standby is registered, if asked)."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats.executor_pid not in (0, not_pid) and (stats.standby_executor_pid or not standby):
            return stats.executor_pid, stats.standby_executor_pid
        time.sleep(0.1)
    raise AssertionError("no executor registered:\n" + "".join(server.log[-30:]))


def wait_for_line(server, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := [line for line in server.log if text in line]:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no line with {text!r}:\n" + "".join(server.log[-30:]))


def assert_stops_as_a_crash_loop(server) -> str:
    """Serve's line when it stops: it must, with exit code 1."""
    code = server.proc.wait(timeout=60)
    assert code == 1, "".join(server.log[-30:])
    return wait_for_line(server, "crash loop", timeout=5)


def test_a_second_death_past_a_budget_of_one_stops_serve_naming_the_flag(tmp_path, model_dir):
    srv = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(48 << 20),
                       "--standby-executors", "0", "--max-executor-restarts", "1",
                       "--restart-window-s", "60")
    try:
        first, _ = executor_pids(srv)
        os.kill(first, signal.SIGKILL)
        assert "restarting (death 1 of 1 in the last 60 s)" in wait_for_line(srv, "restarting")
        second, _ = executor_pids(srv, not_pid=first)  # the cold restart serves
        os.kill(second, signal.SIGKILL)
        line = assert_stops_as_a_crash_loop(srv)
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    assert "2 executor deaths" in line and "within 60 s" in line
    assert "--max-executor-restarts 1" in line and "--restart-window-s 60" in line
    # What the harness (and so bench_recovery) makes of the call the stopped server refuses.
    with pytest.raises(grpc.RpcError) as refused:
        srv.stats()
    message = srv.why_stopped(refused.value)
    assert "crash-loop guard tripped" in message and "larger --max-executor-restarts" in message
    assert "--max-executor-restarts 1 allows" in message  # it quotes serve's own line


def test_a_standby_takeover_spends_the_budget_like_a_cold_restart(tmp_path, model_dir):
    srv = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(48 << 20),
                       "--standby-executors", "1", "--max-executor-restarts", "1",
                       "--threads", "1")
    try:
        first, standby = executor_pids(srv, standby=True)
        os.kill(first, signal.SIGKILL)
        took_over = wait_for_line(srv, "the standby (pid")
        assert f"(pid {standby})" in took_over and "(death 1 of 1 in the last 120 s)" in took_over
        # A standby is ready again, and still the second death is one too many.
        active, _ = executor_pids(srv, standby=True, not_pid=first)
        assert active == standby
        os.kill(active, signal.SIGKILL)
        line = assert_stops_as_a_crash_loop(srv)
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    assert "2 executor deaths (restarts and standby takeovers)" in line
    assert "--max-executor-restarts 1" in line
    assert sum("the standby (pid" in x for x in srv.log) == 1  # serve's own line

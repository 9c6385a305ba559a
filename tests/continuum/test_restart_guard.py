"""serve's crash-loop guard without a server: its flags, their validation, the budget and
window it keeps (the budget bench_recovery gives serve: tests/bench/test_bench_recovery.py)."""

from __future__ import annotations

import shutil

import pytest

from continuum.cli import build_parser
from continuum.serve.restart_guard import RestartGuard
from continuum.serve.supervisor import ServeError, Supervisor


def serve_args(*flags: str):
    return build_parser()[0].parse_args(["serve", "--port", "1", "--http-port", "2", *flags])


def test_the_flags_default_to_five_deaths_in_120_s_and_reach_the_supervisor():
    default = Supervisor(serve_args())
    shutil.rmtree(default.workdir)
    assert (default.executor_deaths.max_restarts, default.executor_deaths.window_s) == (5, 120)
    sup = Supervisor(serve_args("--max-executor-restarts", "0", "--restart-window-s", "7.5"))
    try:
        assert (sup.executor_deaths.max_restarts, sup.executor_deaths.window_s) == (0, 7.5)
        assert not sup.executor_deaths.record(0.0)  # 0: the first death stops the server
    finally:
        shutil.rmtree(sup.workdir)


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--max-executor-restarts", "-1", "must be >= 0, got -1"),
    ("--restart-window-s", "0", "must be > 0, got 0.0"),
    ("--restart-window-s", "-3", "must be > 0, got -3.0"),
    ("--restart-window-s", "nan", "must be > 0, got nan"),
])
def test_bad_guard_values_stop_serve_naming_the_flag(flag, value, message):
    with pytest.raises(ServeError, match=f"{flag} {message}"):
        Supervisor(serve_args(flag, value))


@pytest.mark.parametrize(("flag", "value"), [("--max-executor-restarts", "2.5"),
                                             ("--restart-window-s", "soon")])
def test_guard_flags_that_are_no_number_are_usage_errors(capsys, flag, value):
    with pytest.raises(SystemExit) as info:
        serve_args(flag, value)
    assert info.value.code == 2 and f"argument {flag}: invalid" in capsys.readouterr().err


def test_the_help_documents_both_flags(capsys):
    with pytest.raises(SystemExit):
        serve_args("--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "--max-executor-restarts N" in out and "0: never restart" in out
    assert "--restart-window-s X" in out and "(default: 120)" in out


def test_n_deaths_per_window_are_replaced_and_the_next_one_is_not():
    guard = RestartGuard(2, 10.0)
    assert [guard.record(t) for t in (0.0, 1.0, 2.0)] == [True, True, False]
    assert guard.progress() == "3 of 2 in the last 10 s"
    line = guard.tripped(-9)
    assert "exited with code -9: 3 executor deaths" in line and "crash loop" in line
    assert "--max-executor-restarts 2" in line and "--restart-window-s 10" in line


def test_deaths_older_than_the_window_no_longer_count():
    guard = RestartGuard(2, 10.0)
    assert guard.record(0.0) and guard.record(5.0)
    assert guard.record(10.0)  # the death at 0 is 10 s old: out of the window
    assert guard.count == 2
    assert not guard.record(14.0)  # 5, 10 and 14 are within 10 s

"""bench_recovery gives serve a crash-loop budget its faults fit (what it makes of a call
the stopped server refuses is ``Serve.why_stopped``: tests/integration/test_crash_loop.py)."""

from __future__ import annotations

from benchmarks.bench_recovery import restart_budget
from continuum.serve.restart_guard import RestartGuard
from tests.continuum.test_restart_guard import serve_args


def test_bench_recovery_gives_serve_a_budget_its_faults_fit():
    faults, flags = restart_budget(3)
    assert faults == 6
    assert serve_args(*flags).max_executor_restarts == 12
    burst = [float(t) for t in range(faults)]  # every fault within one window
    assert all(map(RestartGuard(serve_args(*flags).max_executor_restarts, 120.0).record, burst))
    assert not all(map(RestartGuard(5, 120.0).record, burst))  # serve's default would stop
    assert restart_budget(1, given=1) == (2, ["--max-executor-restarts", "1"])

"""At the step deadline the executor's process decides (scheduler_svc/hang_check.py):
stopped or idle is a hang, busy is a slow step given more time up to the cold limit;
a process that is not a visible executor leaves the deadline alone to decide."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from scheduler_svc.hang_check import await_answer, progress, working
from scheduler_svc.step_deadline import StepDeadlines

pytestmark = pytest.mark.spawns  # starts processes of its own (tests/tiers.py)

BUSY = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"
IDLE = "import time; time.sleep(60)"


@pytest.fixture
def process(request):
    """A child whose command line names executor_svc (as progress() requires)."""
    proc = subprocess.Popen([sys.executable, "-c", request.param, "executor_svc"])
    time.sleep(0.3)  # started, and past its imports
    yield proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


def _deadlines() -> StepDeadlines:
    d = StepDeadlines(floor_s=0.5, cold_floor_s=0.75)  # limit 1.5 s; windows a busy box
    # still gives CPU in
    d.reset(1e4)
    for _ in range(d.warmup_steps):
        d.observe(0.01, 4)
    return d


def _wait(pid: int) -> tuple[object, str, float]:
    async def go():
        answer = asyncio.get_running_loop().create_future()  # never answered
        start = time.monotonic()
        result, why = await await_answer(answer, _deadlines(), 4, pid)
        return result, why, time.monotonic() - start
    return asyncio.run(go())


def test_a_process_that_is_not_an_executor_is_not_looked_at():
    assert progress(os.getpid()) is None  # pytest's command line
    assert progress(2**22 + 12345) is None  # no such process
    result, why, _ = _wait(os.getpid())
    assert result is None and "not visible" in why


@pytest.mark.parametrize("process", [IDLE], indirect=True)
def test_an_idle_or_stopped_executor_is_hung_at_the_deadline(process):
    result, why, waited = _wait(process.pid)
    assert result is None and "idle" in why and waited < 1.5  # not the 1.5 s limit
    os.kill(process.pid, signal.SIGSTOP)
    time.sleep(0.1)
    assert progress(process.pid)[0] == "T"
    result, why, _ = _wait(process.pid)
    assert "stopped" in why


@pytest.mark.parametrize("process", [BUSY], indirect=True)
def test_a_busy_executor_gets_time_up_to_the_cold_limit(process):
    before = progress(process.pid)
    time.sleep(0.5)
    assert working(before, progress(process.pid))
    result, why, waited = _wait(process.pid)
    assert result is None and "busy" in why and waited >= 1.5

"""tests/conftest.py's hang guard: a test blocked inside C, where pytest-timeout's signal
cannot raise, is ended at twice its timeout with its traceback, and the run fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import HANG_FACTOR, hang_s

pytestmark = pytest.mark.spawns  # starts processes of its own (tests/tiers.py)

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_the_limit_is_twice_the_tests_own_timeout(request):
    assert hang_s(request.node) == HANG_FACTOR * float(request.config.getini("timeout"))


@pytest.mark.timeout(450)
def test_a_timeout_mark_moves_the_limit(request):
    assert hang_s(request.node) == HANG_FACTOR * 450


@pytest.mark.timeout(0)
def test_no_timeout_no_guard(request):
    assert hang_s(request.node) is None


def test_a_test_blocked_in_c_is_ended_with_its_traceback(tmp_path):
    blocked = tmp_path / "test_blocked.py"
    # SIGALRM blocked: pytest-timeout's signal cannot act, as in a call that retries
    # EINTR in C or a finalizer that swallows the exception (zmq's term() in __del__).
    blocked.write_text(
        "import signal, time\n\n"
        "def test_waits_where_no_signal_reaches():\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "    time.sleep(60)\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-o", "timeout=2",
         "-p", "no:cacheprovider", str(blocked)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Timeout (0:00:04)!" in done.stderr, done.stderr[-2000:]
    assert "test_waits_where_no_signal_reaches" in done.stderr

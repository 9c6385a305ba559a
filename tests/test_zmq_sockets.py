"""runtime/zmq_sockets.py: a link collected in a reference cycle without close() must not hang
the process in zmq's Context.__del__ (it once hung a whole test run). Each case runs in a
child process with a timeout, so a regression fails here instead of hanging the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.spawns  # starts processes of its own (tests/tiers.py)

ROOT = __file__.rsplit("/tests/", 1)[0]

# An owner of a context and two sockets, one with a message queued for a peer that never
# comes; `owner.me = owner` puts all of them into one cycle, which only the collector frees.
PROGRAM = textwrap.dedent("""
    import gc, sys, zmq
    sys.path.insert(0, {root!r})
    from runtime.zmq_sockets import release_on_collect

    class Owner:
        def __init__(self, released):
            self.ctx = zmq.Context()
            self.a = self.ctx.socket(zmq.DEALER)
            self.b = self.ctx.socket(zmq.DEALER)
            self.b.connect("ipc://{tmp}/nobody.sock")
            self.b.send(b"pending")
            self.me = self
            if released:
                self.release = release_on_collect(self, self.ctx, self.a, self.b)

    {body}
    print("collected", flush=True)
""")


def run(tmp_path, body: str, timeout_s: float) -> subprocess.CompletedProcess:
    code = PROGRAM.format(root=ROOT, tmp=tmp_path, body=textwrap.dedent(body).strip())
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                          text=True, timeout=timeout_s)


def test_a_bare_context_in_a_cycle_hangs_the_collector(tmp_path):
    """The failure this module exists for, shown on pyzmq itself: without the finalizer the
    collector blocks in Context.term() (if pyzmq ever fixes this, the test says so)."""
    with pytest.raises(subprocess.TimeoutExpired):
        run(tmp_path, """
            for _ in range(50):
                Owner(released=False)
                gc.collect()
        """, timeout_s=5)


def test_a_released_owner_in_a_cycle_is_collected(tmp_path):
    done = run(tmp_path, """
        for _ in range(50):
            Owner(released=True)
            gc.collect()
    """, timeout_s=60)
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr


def test_an_explicit_close_runs_once_and_the_collector_then_has_nothing_to_do(tmp_path):
    done = run(tmp_path, """
        owner = Owner(released=True)
        owner.release()
        assert owner.ctx.closed and owner.a.closed and owner.b.closed
        owner.release()  # a second close is a no-op
        del owner
        gc.collect()
    """, timeout_s=60)
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr


@pytest.mark.parametrize("link", ["scheduler", "executor"])
def test_both_links_left_unclosed_in_a_cycle_are_collected(tmp_path, link):
    """The scheduler's ROUTER (with its monitor) and the executor's DEALER (with a Hello
    queued for a scheduler that never answers), each leaked in a cycle."""
    make = {
        "scheduler": "from scheduler_svc.link import ExecutorLink\n"
                     f"l = ExecutorLink('ipc://{tmp_path}/s.sock', None, None, None)",
        "executor": "from executor_svc.link import SchedulerLink\n"
                    "from protos.continuum.v1 import executor_pb2 as pb\n"
                    f"l = SchedulerLink('ipc://{tmp_path}/nobody.sock')\n"
                    "l.send('hello', pb.Hello(incarnation='x'))",
    }[link]
    done = run(tmp_path, f"""
        for _ in range(20):
{textwrap.indent(make, ' ' * 12)}
            l.me = l
            del l
            gc.collect()
    """, timeout_s=60)
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr

"""The shared-memory plan ring (runtime/shm_ring.py) between real processes: every
reader gets every payload byte for byte and in order, the writer never overwrites an unread
slot, a dead or hung peer raises instead of wedging the other end, and no name is left in
/dev/shm. The ring as the tp executor's plan channel runs in tests/executor/test_tp.py."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from runtime import shm_ring
from runtime.shm_ring import RingError, RingReader, RingWriter

pytestmark = [pytest.mark.skipif(shm_ring.available() is not None,
                                 reason=f"no ring here: {shm_ring.available()}"),
              pytest.mark.spawns]  # starts reader processes (tests/tiers.py)

# A reader process: attaches, prints "ready", then one sha256 per payload until an empty one.
_READER = """
import hashlib, sys
from runtime.shm_ring import RingReader
r = RingReader(sys.argv[1], sys.argv[2], int(sys.argv[3]))
print("ready", flush=True)
while True:
    data = r.recv(30.0)
    if not data:
        break
    print(len(data), hashlib.sha256(data).hexdigest(), flush=True)
r.close()
"""
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ours() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("continuum-plan-")}


def _reader(writer: RingWriter, index: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _READER, writer.name, writer.doorbell,
                             str(index)], stdout=subprocess.PIPE, text=True, cwd=_ROOT)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def writer(tmp_path):
    before = _ours()
    w = RingWriter(2, str(tmp_path), num_slots=4, slot_bytes=256)
    yield w
    w.close()
    assert _ours() <= before  # closed: its name is gone


def test_two_reader_processes_get_every_payload_in_order_small_slots_and_chunks(writer):
    readers = [_reader(writer, i) for i in range(2)]
    writer.unlink()  # both mapped it: the name can go now
    assert writer.name not in _ours()
    # One byte, exactly a slot's room, a chunked one far larger than the whole ring (4 x 256
    # bytes): the writer must wait for the readers slot by slot, never overwrite.
    payloads = [b"\x01", bytes(range(232)), os.urandom(50_000), b"plan" * 999]
    for p in payloads:
        writer.send(p, timeout_s=30)
    writer.send(b"", timeout_s=30)  # the readers' stop
    want = [f"{len(p)} {hashlib.sha256(p).hexdigest()}" for p in payloads]
    for proc in readers:
        out, _ = proc.communicate(timeout=30)
        assert out.split("\n")[:-1] == want and proc.returncode == 0


def test_a_full_ring_waits_for_its_slowest_reader_instead_of_overwriting(writer):
    fast, slow = (RingReader(writer.name, writer.doorbell, i) for i in range(2))
    for i in range(4):  # the ring's 4 slots
        writer.send(bytes([i]) * 10, timeout_s=1)
        assert fast.recv(timeout_s=1) == bytes([i]) * 10
    with pytest.raises(RingError, match="full"):
        writer.send(b"overwrite?", timeout_s=0.2)  # ``slow`` has read none of them
    assert [slow.recv(timeout_s=1) for _ in range(4)] == [bytes([i]) * 10 for i in range(4)]
    writer.send(b"next", timeout_s=1)  # room again
    assert slow.recv(1) == fast.recv(1) == b"next"
    with pytest.raises(RingError, match="within the timeout"):
        slow.recv(timeout_s=0.2)  # nothing sent: a hung writer is a timeout, not a hang
    writer.close()
    with pytest.raises(RingError, match="closed"):
        fast.recv(timeout_s=5)
    fast.close()
    slow.close()


def test_a_dead_reader_fails_the_writer_at_once(writer):
    readers = [_reader(writer, i) for i in range(2)]
    readers[1].send_signal(signal.SIGKILL)
    readers[1].wait()
    start = time.monotonic()
    with pytest.raises(RingError, match="rank 2 .* is gone"):
        for _ in range(8):  # more than the 4 slots: the dead reader's acks never come
            writer.send(b"x", timeout_s=20)
    assert time.monotonic() - start < 10  # well before the timeout: its pid is gone
    readers[0].kill()
    readers[0].wait()


def test_a_dead_writer_fails_its_reader_and_leaves_no_name(tmp_path):
    code = ("import sys, time\nfrom runtime.shm_ring import RingWriter\n"
            f"w = RingWriter(1, {str(tmp_path)!r})\nprint(w.name, w.doorbell, flush=True)\n"
            "sys.stdin.readline()\nw.unlink()\nprint('unlinked', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=_ROOT)
    name, doorbell = proc.stdout.readline().split()
    reader = RingReader(name, doorbell, 0)
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "unlinked"
    proc.kill()
    proc.wait()
    start = time.monotonic()
    with pytest.raises(RingError, match="rank 0 .* is gone"):
        reader.recv(timeout_s=20)
    assert time.monotonic() - start < 10
    reader.close()
    assert name not in _ours()


def test_a_writer_killed_before_unlinking_is_swept_by_the_next(tmp_path):
    code = (f"from runtime.shm_ring import RingWriter\nw = RingWriter(1, {str(tmp_path)!r})"
            "\nprint(w.name, flush=True)\nimport time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=_ROOT)
    name = proc.stdout.readline().strip()
    assert name in _ours()
    proc.kill()
    proc.wait()
    RingWriter(1, str(tmp_path)).close()  # sweeps rings whose writer pid is gone
    assert name not in _ours()


def test_a_reader_refuses_what_is_not_a_ring(writer):
    with pytest.raises(ValueError, match="not a plan ring"):
        RingReader("../etc/passwd", writer.doorbell, 0)
    with pytest.raises(ValueError, match="no reader 5"):
        RingReader(writer.name, writer.doorbell, 5)


def _tp_rank(rank: int, tmp: str, results) -> None:
    """Two groups in turn, in one process (torch's import is the slow part): the ring, then
    the broadcast because rank 1 cannot attach (as when /dev/shm is not shared with it)."""
    from types import SimpleNamespace

    from executor_svc import tp_comm

    big = bytes(range(256)) * 400  # past gloo's inline header and a ring slot
    reader = tp_comm.shm_ring.RingReader
    for attempt, break_attach in enumerate((False, True)):
        if break_attach and rank == 1:
            def refuse(*args):
                raise OSError("no such ring here")

            tp_comm.shm_ring.RingReader = refuse
        comm = tp_comm.TPComm(SimpleNamespace(rank=rank, tp_size=2))
        comm.connect(f"file://{tmp}/rendezvous-{attempt}", timeout_s=60, device="cpu")
        if rank == 0:
            comm.send_command(tp_comm.Command.PLAN, big)
            comm.send_command(tp_comm.Command.STOP)
        else:
            got = [comm.receive_command(), comm.receive_command()]
            results.put((comm._reader is not None, got == [(tp_comm.Command.PLAN, big),
                                                          (tp_comm.Command.STOP, b"")]))
        comm.close()
        tp_comm.shm_ring.RingReader = reader


def test_tp_commands_take_the_ring_or_all_ranks_fall_back_to_gloo(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, str(tmp_path), results)) for r in range(2)]
    before = _ours()
    for p in procs:
        p.start()
    assert results.get(timeout=120) == (True, True)  # the ring, every byte
    assert results.get(timeout=120) == (False, True)  # gloo on every rank, every byte
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert _ours() <= before

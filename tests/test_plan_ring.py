"""The scheduler → executor plan ring (runtime/plan_ring.py): frames arrive in order and
byte for byte; a frame of another ring (a stale generation), one written without the key
(a foreign process) or copied into another slot is refused and consumed; a plan sent over
ZeroMQ before a ring frame runs first; a full ring or an oversized plan is refused at once
(the caller sends over ZeroMQ), also when the reader was killed; nothing stays in /dev/shm.
The ring under a real scheduler and executor: tests/integration/test_plan_channel.py."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from runtime import plan_ring, shm_ring
from runtime.plan_ring import FrameError, PlanRingReader, PlanRingWriter

pytestmark = [pytest.mark.skipif(shm_ring.available() is not None,
                                 reason=f"no ring here: {shm_ring.available()}"),
              pytest.mark.spawns]  # starts reader processes (tests/tiers.py)
SECRET = b"s" * 32
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ours() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("continuum-plan-")}


def _attach(writer: PlanRingWriter, secret: bytes | None, incarnation: str):
    return PlanRingReader(writer.name, writer.generation, writer.offered_key, secret,
                          incarnation)


@pytest.fixture
def pair():
    before = _ours()
    writer = PlanRingWriter(SECRET, "inc", num_slots=4, slot_bytes=1024)
    reader = _attach(writer, SECRET, "inc")
    writer.unlink()
    yield writer, reader
    reader.close()
    writer.close()
    assert _ours() <= before


def test_frames_arrive_in_order_and_the_ring_file_is_private(pair):
    writer, reader = pair
    assert reader.poll() is None
    for i in range(10):
        assert writer.try_write(b"plan %d" % i)
        assert reader.poll() == b"plan %d" % i
    assert reader.poll() is None


def test_the_file_is_mode_0600_and_its_key_is_not_in_the_offer():
    writer = PlanRingWriter(SECRET, "inc")
    try:
        assert os.stat(f"/dev/shm/{writer.name}").st_mode & 0o777 == 0o600
        assert not writer.offered_key  # derived from the secret on both sides
        insecure = PlanRingWriter(None, "inc")
        assert len(insecure.offered_key) == 32  # the opt-out: the offer carries it
        reader = _attach(insecure, None, "inc")
        insecure.try_write(b"p")
        assert reader.poll() == b"p"
        reader.close()
        insecure.close()
    finally:
        writer.close()


def test_a_full_ring_and_an_oversized_plan_are_refused_without_waiting(pair):
    writer, reader = pair
    assert not writer.try_write(b"x" * (writer.max_payload + 1))
    for _ in range(4):
        assert writer.try_write(b"p")
    started = time.monotonic()
    assert not writer.try_write(b"p")  # the slot it would reuse is unread
    assert time.monotonic() - started < 0.01
    assert reader.poll() == b"p"
    assert writer.try_write(b"q")  # one slot free again


def test_a_stale_generation_is_refused(pair):
    writer, reader = pair
    reader.generation += 1  # this reader belongs to another ring of the same name and key
    writer.try_write(b"old")
    with pytest.raises(FrameError, match="generation"):
        reader.poll()
    assert reader.poll() is None  # consumed: the next frame is read normally


def test_a_reader_with_another_incarnation_cannot_verify_the_frames():
    writer = PlanRingWriter(SECRET, "old-incarnation")
    reader = _attach(writer, SECRET, "new-incarnation")
    try:
        writer.try_write(b"plan")
        with pytest.raises(FrameError, match="tag"):
            reader.poll()
    finally:
        reader.close()
        writer.close()


def test_a_foreign_frame_is_refused_and_the_next_real_one_still_reads(pair):
    writer, reader = pair
    ring = shm_ring.RingWriter.__new__(shm_ring.RingWriter)  # a process with the file only
    ring.ring, ring._next = writer._ring.ring, writer._ring.next_number
    view = ring.reserve()
    head = struct.pack("<qqqq", writer.generation, ring.next_number, 0, 4)
    view[:64 + 4] = b"\0" * 32 + head + b"evil"
    view.release()
    ring.publish(64 + 4)
    writer._ring._next += 1
    with pytest.raises(FrameError, match="tag"):
        reader.poll()
    assert writer.try_write(b"real")
    assert reader.poll() == b"real"


def test_a_frame_copied_into_a_later_slot_is_refused(pair):
    writer, reader = pair
    writer.try_write(b"step 1")
    r = writer._ring.ring
    first = r.bytes[8 * r.slot_word(1) : 8 * r.slot_word(1) + r.slot_bytes].tobytes()
    assert reader.poll() == b"step 1"
    r.bytes[8 * r.slot_word(2) + 8 : 8 * r.slot_word(2) + r.slot_bytes] = first[8:]
    r.words[r.slot_word(2)] = 2  # a replay of frame 1 published as message 2
    with pytest.raises(FrameError, match="tag|slot"):
        reader.poll()


def test_a_plan_sent_over_zmq_first_runs_first(pair):
    writer, reader = pair
    writer.sent_over_zmq()  # plan A: too large for the ring, sent over ZeroMQ
    writer.try_write(b"plan B")
    assert reader.poll() is None  # B waits until A is received
    reader.received_over_zmq()
    assert reader.poll() == b"plan B"


def test_the_writer_sees_when_the_reader_sleeps(pair):
    writer, reader = pair
    assert reader.wait(0.0) is None
    assert writer.reader_sleeping()
    reader.awake()
    assert not writer.reader_sleeping()
    writer.try_write(b"p")
    assert reader.wait(0.01) == b"p"
    assert not writer.reader_sleeping()


_READER = """
import sys
from runtime.plan_ring import PlanRingReader
r = PlanRingReader(sys.argv[1], int(sys.argv[2]), b"", b"s" * 32, "inc")
print("ready", flush=True)
while True:
    r.poll()
"""


def test_a_killed_reader_never_blocks_the_writer():
    writer = PlanRingWriter(SECRET, "inc", num_slots=2, slot_bytes=512)
    proc = subprocess.Popen([sys.executable, "-c", _READER, writer.name, str(writer.generation)],
                            stdout=subprocess.PIPE, text=True, cwd=_ROOT)
    try:
        assert proc.stdout.readline().strip() == "ready"
        writer.unlink()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        started = time.monotonic()
        results = [writer.try_write(b"plan") for _ in range(50)]
        assert time.monotonic() - started < 0.05
        assert results.count(True) <= 2 + 2 and not results[-1]  # full: ZeroMQ's turn
    finally:
        proc.kill()
        writer.close()


def test_an_offer_that_cannot_be_attached_raises():
    with pytest.raises(OSError):
        PlanRingReader("continuum-plan-1-gone", 1, b"", SECRET, "i")
    with pytest.raises(ValueError):
        PlanRingReader("../etc/passwd", 1, b"", SECRET, "i")
    with pytest.raises(ValueError):  # the opt-out without a key in the offer
        PlanRingReader("continuum-plan-1-gone", 1, b"", None, "i")
    assert plan_ring.SPIN_S > 0


def test_a_reader_spins_only_where_a_core_is_left_for_it():
    assert plan_ring.spin_budget(2) == 0.0
    assert plan_ring.spin_budget(plan_ring.MIN_CPUS_TO_SPIN) == plan_ring.SPIN_S
    assert plan_ring.spin_budget() in (0.0, plan_ring.SPIN_S)

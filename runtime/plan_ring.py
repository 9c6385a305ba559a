"""Plans from the scheduler to its executor through shared memory (docs/design.md §4,
docs/gpu.md).

One ring (runtime/shm_ring.py, mode 0600, random name) per executor incarnation, offered in
heartbeats (``Heartbeat.plan_ring``); once the executor names it back, plans go there and
the name is unlinked. ZeroMQ carries everything else, and any plan the ring cannot take.
Every frame is authenticated, so a process that opens the ring cannot inject a plan::

    tag (32 bytes) | generation, number, zmq_before, length (int64 each) | payload

``tag``: keyed BLAKE2b-256 (RFC 7693) of everything after it, not HMAC-SHA256: checked
right after a forward pass flushed the caches it is ~3x cheaper (docs/gpu.md). The key
derives from the internal secret, incarnation, ring name and ``generation``
(runtime/internal_auth.py; random, sent in the offer, under the insecure opt-out).
``number`` refuses a frame copied into a later slot, ``generation`` one of another ring;
``zmq_before``: plans sent over ZeroMQ before it, so the reader keeps the send order.
The writer never waits (``try_write`` False: use ZeroMQ); a sleeping reader is woken by a
``ring_bell`` frame.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import time
from collections.abc import Callable

from runtime import internal_auth, shm_ring

_TAG = 32
_HEAD = struct.Struct("<qqqq")  # generation, number, zmq_before, length
_FRAME = _TAG + _HEAD.size
NUM_SLOTS = 8
SLOT_BYTES = 256 << 10  # a decode plan for 1,024 sequences is about 4 KiB
# How long the reader spins on the ring after a plan before it sleeps on ZeroMQ: the
# scheduler's update and next schedule at 1,024 running sequences take about 1 ms.
SPIN_S = 2e-3
# Spinning pays only where a core is left for it: with fewer, the spinner takes the core
# the scheduler needs to build the plan it waits for (measured on 2 vCPUs, async
# scheduling off: a 1.1 ms idle gap spinning against 0.1 ms over ZeroMQ).
MIN_CPUS_TO_SPIN = 4


def spin_budget(num_cpus: int | None = None) -> float:
    """How long a reader on this host spins after a plan (0: it sleeps at once)."""
    if num_cpus is None:
        num_cpus = len(os.sched_getaffinity(0))
    return SPIN_S if num_cpus >= MIN_CPUS_TO_SPIN else 0.0


class FrameError(ValueError):
    """A ring frame that is not a plan from this ring's writer (consumed and dropped)."""


def ring_key(secret: bytes | None, name: str, generation: int, incarnation: str,
             offered_key: bytes = b"") -> bytes:
    """The frames' HMAC key: derived from the secret (never sent), or the offer's own."""
    if secret is None:
        return offered_key
    return internal_auth.tag(secret, b"continuum plan ring\0%s\0%s\0%d" % (
        incarnation.encode(), name.encode(), generation))


class PlanRingWriter:
    """The scheduler's end, for one executor incarnation."""

    def __init__(self, secret: bytes | None, incarnation: str, num_slots: int = NUM_SLOTS,
                 slot_bytes: int = SLOT_BYTES) -> None:
        self._ring = shm_ring.RingWriter(1, None, num_slots, slot_bytes)
        self.name = self._ring.name
        self.generation = secrets.randbits(62) + 1
        # What the offer carries besides name and generation: the key only without a secret.
        self.offered_key = secrets.token_bytes(32) if secret is None else b""
        self._key = ring_key(secret, self.name, self.generation, incarnation, self.offered_key)
        self.max_payload = self._ring.ring.chunk_bytes - _FRAME
        self.num_zmq_plans = 0  # plans sent over ZeroMQ while this ring served

    def try_write(self, payload: bytes) -> bool:
        """Writes ``payload`` as the next frame; False (nothing written) when it is larger
        than a slot or the reader has not consumed the slot it would reuse."""
        if len(payload) > self.max_payload:
            return False
        view = self._ring.reserve()
        if view is None:
            return False
        head = _HEAD.pack(self.generation, self._ring.next_number, self.num_zmq_plans, len(payload))
        # Signed from our own bytes, never from the shared pages a peer could change.
        tag = hashlib.blake2b(head, key=self._key, digest_size=_TAG)
        tag.update(payload)
        view[_TAG:_FRAME] = head
        view[_FRAME : _FRAME + len(payload)] = payload
        view[:_TAG] = tag.digest()
        view.release()
        self._ring.publish(_FRAME + len(payload))
        return True

    def sent_over_zmq(self) -> None:
        """A plan went over ZeroMQ instead: later frames wait for it."""
        self.num_zmq_plans += 1

    def reader_sleeping(self) -> bool:
        """The executor waits on ZeroMQ: a frame just written needs a doorbell."""
        return self._ring.sleeping(0)

    def unlink(self) -> None:
        """The executor mapped the ring: its name goes, nothing is left to leak."""
        self._ring.unlink()

    def close(self) -> None:
        self._ring.close()


class PlanRingReader:
    """The executor's end, from the offer's ``name``, ``generation`` and key (empty: derived).
    Raises OSError/ValueError when it cannot be attached (another host's /dev/shm, a name
    that is gone): the plans then stay on ZeroMQ."""

    def __init__(self, name: str, generation: int, offered_key: bytes, secret: bytes | None,
                 incarnation: str) -> None:
        self.name, self.generation = name, generation
        self._key = ring_key(secret, name, generation, incarnation, offered_key)
        if len(self._key) != 32:
            raise ValueError("the plan ring's offer has no usable key")
        self._ring = shm_ring.RingReader(name, "", 0)
        self.num_zmq_plans = 0  # plans received over ZeroMQ since attaching

    def poll(self) -> bytes | None:
        """The next plan's payload if its frame is published and its turn has come (every
        ZeroMQ plan sent before it was received), else None. Raises FrameError for a
        frame that fails its checks; that frame is consumed."""
        view = self._ring.peek()
        if view is None:
            return None
        try:
            if len(view) >= _FRAME and _HEAD.unpack_from(view, _TAG)[2] > self.num_zmq_plans:
                return None  # a plan sent over ZeroMQ before it is still on its way
            frame = bytes(view)  # checked and parsed from our copy, not the shared pages
        finally:
            view.release()
        number = self._ring.next_number
        self._ring.consume()
        return self._check(frame, number)

    def _check(self, frame: bytes, number: int) -> bytes:
        if len(frame) < _FRAME:
            raise FrameError(f"a {len(frame)}-byte ring frame")
        generation, got, _, length = _HEAD.unpack_from(frame, _TAG)
        tag = hashlib.blake2b(memoryview(frame)[_TAG:], key=self._key, digest_size=_TAG)
        if not hmac.compare_digest(tag.digest(), frame[:_TAG]):
            raise FrameError("a ring frame with a wrong tag (not written by the scheduler)")
        if generation != self.generation:
            raise FrameError(f"a ring frame of generation {generation}, expected "
                             f"{self.generation} (a stale ring)")
        if got != number or length != len(frame) - _FRAME:
            raise FrameError(f"ring frame {got} ({length} bytes) in slot {number}")
        return frame[_FRAME:]

    def wait(self, spin_s: float, interrupt: Callable[[], bool] | None = None) -> bytes | None:
        """Spins up to ``spin_s`` (yielding the core) for the next plan, or until
        ``interrupt()`` (checked now and then: the caller's ZeroMQ socket has a frame, a
        plan the ring could not take, say); None means the caller waits on ZeroMQ, where
        a doorbell will come for a later frame."""
        deadline = time.monotonic() + spin_s
        spins = 0
        while True:
            payload = self.poll()
            if payload is not None:
                return payload
            spins += 1
            if time.monotonic() >= deadline or (
                    interrupt is not None and spins % 16 == 0 and interrupt()):
                break
            os.sched_yield()
        self._ring.set_sleeping(True)
        payload = self.poll()  # written before the writer could see that we sleep
        if payload is not None:
            self._ring.set_sleeping(False)
        return payload

    def awake(self) -> None:
        """Back from ZeroMQ: frames written from now on need no doorbell."""
        self._ring.set_sleeping(False)

    def received_over_zmq(self) -> None:
        self.num_zmq_plans += 1

    def close(self) -> None:
        self._ring.close()

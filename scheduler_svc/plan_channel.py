"""Which way each plan goes to the current executor: its shared-memory ring or ZeroMQ.

With ``--plan-channel shm`` (and ``auto`` on 4+ CPUs: with fewer the ring's reader has no
core to spin on, docs/gpu.md) every executor incarnation that becomes the peer gets a
fresh ring (runtime/plan_ring.py), offered in heartbeats; plans take it once the
executor's heartbeat names it, and ZeroMQ for any plan the ring cannot take now (too
large, or its slot still unread). Nothing here ever waits.
"""

from __future__ import annotations

import os

import structlog

from protos.continuum.v1 import executor_pb2 as pb
from runtime import shm_ring
from runtime.plan_ring import MIN_CPUS_TO_SPIN, PlanRingWriter
from scheduler_svc.process_config import PLAN_CHANNELS as CHANNELS

log = structlog.get_logger("scheduler.plan_channel")


def ring_unavailable(channel: str, address: str, num_cpus: int | None = None) -> str | None:
    """Why plans cannot (or, for ``auto``, should not) use shared memory with this
    configuration and ``num_cpus`` (default: this process's), or None."""
    if channel == "zmq":
        return "--plan-channel zmq"
    if not address.startswith("ipc://"):
        return f"the executor channel {address} is not ipc:// (another host, maybe)"
    why = shm_ring.available()
    if why is None and channel == "auto":
        if num_cpus is None:
            num_cpus = len(os.sched_getaffinity(0))
        if num_cpus < MIN_CPUS_TO_SPIN:
            why = (f"--plan-channel auto on {num_cpus} CPUs: the ring's reader has no core "
                   "to spin on, and ZeroMQ is then as fast (--plan-channel shm forces the "
                   "ring)")
    return why


class PlanChannel:
    """Owns the current peer's ring. ``renew(incarnation)`` whenever the peer changes."""

    def __init__(self, channel: str, address: str, secret: bytes | None) -> None:
        if channel not in CHANNELS:
            raise ValueError(f"plan channel {channel!r}, expected one of {CHANNELS}")
        self.why_not = ring_unavailable(channel, address)
        self._secret = secret
        self.ring: PlanRingWriter | None = None
        self.confirmed = False  # the peer's heartbeat named the ring: plans may use it
        self.num_ring_plans = 0
        self.num_zmq_plans = 0
        if self.why_not is not None:
            log.info("plans go over ZeroMQ only", why=self.why_not)

    def renew(self, incarnation: str) -> None:
        """A new peer (or incarnation): the old ring goes, a fresh one is offered."""
        self.close()
        if self.why_not is not None:
            return
        try:
            self.ring = PlanRingWriter(self._secret, incarnation)
        except (OSError, ValueError) as exc:  # /dev/shm full, say: this peer keeps ZeroMQ
            log.warning("no plan ring for this executor; plans go over ZeroMQ",
                        error=str(exc))

    def offer(self) -> pb.PlanRing | None:
        """What a heartbeat to the peer offers: the ring until the peer confirmed it."""
        ring = self.ring
        if ring is None or self.confirmed:
            return None
        return pb.PlanRing(name=ring.name, generation=ring.generation, key=ring.offered_key)

    def confirm(self, name: str) -> None:
        """The peer's heartbeat names the ring it reads."""
        ring = self.ring
        if ring is not None and not self.confirmed and name == ring.name:
            self.confirmed = True
            ring.unlink()  # mapped on both sides: nothing is left to leak
            log.info("plans go through shared memory", ring=ring.name)

    def write(self, frame: bytes) -> bool | None:
        """Puts ``frame`` (a SchedulerMessage) in the ring. None: not written, send it over
        ZeroMQ (counted, so later ring frames wait for it); True: written, and the reader
        sleeps on ZeroMQ, so send a doorbell; False: written, nothing else to do."""
        ring = self.ring
        if ring is not None and self.confirmed and ring.try_write(frame):
            self.num_ring_plans += 1
            return ring.reader_sleeping()
        if ring is not None:
            ring.sent_over_zmq()
        self.num_zmq_plans += 1
        return None

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        self.ring, self.confirmed = None, False

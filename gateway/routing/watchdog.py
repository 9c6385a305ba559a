"""Watches every stream the relay serves, so that none waits forever on a peer that stopped
without closing anything (a hung replica, a client that stopped reading). The relay marks
progress with a few attribute writes per event; one task looks at every stream each TICK_S.

A completion silent for ``progress_timeout_s`` has its replica probed; after PROBE_STRIKES
missed probes in a row its silent streams are cut and continue elsewhere. A replica that
answers is only slow and its streams wait (docs/design.md §5: silence alone never fails a
stream). A stream whose consumer has been writing one response for ``write_stall_s`` is
cancelled (the transport bounds what it holds meanwhile). ``end_all`` is drain's last word:
what still runs gets UNAVAILABLE, not a cut connection."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time

import grpc
import structlog

from gateway.routing.mux import SchedulerStream
from gateway.routing.replicas import Replica
from gateway.routing.upstream import ClientStatus
from protos.continuum.v1 import scheduler_pb2
from runtime.aio import cancel_all

TICK_S = 0.5
PROBE_TIMEOUT_S = 3.0
PROBE_STRIKES = 2
# Silence before a replica is probed. Short is safe: a replica that answers its
# probe is never failed over, so this only bounds how soon a hang is noticed.
PROGRESS_TIMEOUT_S = 5.0
# A client that has not accepted one response for this long is gone in all but name.
WRITE_STALL_S = 30.0

# Bytes an SSE stream may hold beyond the client's TCP window (kernel send buffer, and the
# transport's): thousands of tokens, 640 KiB/s at 100 ms RTT, far above any token rate.
SSE_BUFFER_BYTES = 64 * 1024
_NO_ANSWER = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})
_log = structlog.get_logger("gateway.watchdog")


def bound_send_buffer(transport: asyncio.Transport | None) -> None:
    """Caps the kernel's and the transport's buffer for one SSE client at SSE_BUFFER_BYTES
    each, so one that stops reading meets WRITE_STALL_S, not autotuned megabytes."""
    if transport is None:
        return
    transport.set_write_buffer_limits(high=SSE_BUFFER_BYTES)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SSE_BUFFER_BYTES)


@dataclasses.dataclass(eq=False)
class Completion:
    """One completion's upstream leg, as the relay updates it."""

    replica: Replica | None = None
    call: SchedulerStream | None = None  # its stream on the replica's SubmitMany call
    heard_at: float = 0.0  # monotonic time of the last event (or of the submit)
    parked: bool = False  # handed a response to its consumer, not resumed yet
    stalled: bool = False  # the watchdog cancelled the call: the replica stalled
    ended: ClientStatus | None = None  # the gateway ended it (drain past grace)

    def cut(self) -> None:
        if self.call is not None:
            self.call.cancel()


@dataclasses.dataclass(eq=False)
class Stream:
    """One `Relay.generate` call: the task consuming it and its completions."""

    task: asyncio.Task
    request_id: str
    completions: list[Completion] = dataclasses.field(default_factory=list)
    parked_since: float | None = None  # monotonic time it yielded, while its consumer writes
    slow_reader: bool = False


class Watchdog:
    """The set of live streams and the task that watches them."""

    def __init__(self, on_intervention=lambda reason: None,
                 progress_timeout_s: float | None = None, write_stall_s: float | None = None):
        """The bounds default to the module's constants, read now (tests lower them)."""
        self.progress_timeout_s = progress_timeout_s or PROGRESS_TIMEOUT_S
        self.write_stall_s = write_stall_s or WRITE_STALL_S
        self.streams: set[Stream] = set()
        self.ended: ClientStatus | None = None  # set by end_all
        self.refusing: ClientStatus | None = None  # new streams get this (draining)
        self._on_intervention = on_intervention
        self._task: asyncio.Task | None = None
        self._strikes: dict[Replica, int] = {}  # probes missed in a row, per replica
        self._idle = asyncio.Event()
        self._idle.set()

    def add(self, stream: Stream) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self.streams.add(stream)
        self._idle.clear()

    def discard(self, stream: Stream) -> None:
        self.streams.discard(stream)
        if not self.streams:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no stream is live; False if ``timeout_s`` passed first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    def end_all(self, status: ClientStatus) -> None:
        """Ends every live stream (and any started later) with ``status``; one whose
        consumer is writing ends when it comes back for the next response."""
        self.ended = status
        for stream in list(self.streams):
            for completion in stream.completions:
                completion.ended = status
                if not completion.parked:
                    completion.cut()
        if self.streams:
            self._on_intervention("shutdown")
            _log.warning("ending streams still running after the grace period",
                         streams=len(self.streams))

    async def close(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.check(time.monotonic())
            except Exception:  # never let one bad tick stop the watching
                _log.exception("watchdog check failed")

    async def check(self, now: float) -> None:
        """One look at every stream (see the module docstring)."""
        silent: dict[Replica, list[Completion]] = {}
        for stream in list(self.streams):
            if stream.parked_since is not None:
                if now - stream.parked_since > self.write_stall_s and not stream.slow_reader:
                    stream.slow_reader = True
                    self._on_intervention("slow_reader")
                    _log.warning("client stopped reading; cancelling the request",
                                 request_id=stream.request_id,
                                 blocked_s=round(now - stream.parked_since, 1))
                    stream.task.cancel()
                continue
            for c in stream.completions:
                if (c.call is not None and not c.parked and not c.stalled
                        and c.replica is not None and now - c.heard_at > self.progress_timeout_s):
                    silent.setdefault(c.replica, []).append(c)
        if not silent:
            self._strikes.clear()
            return
        replicas = list(silent)
        alive = await asyncio.gather(*(self._answers(r) for r in replicas))
        self._strikes = {r: n for r, n in self._strikes.items() if r in silent}
        for replica, ok in zip(replicas, alive, strict=True):
            strikes = self._strikes[replica] = 0 if ok else self._strikes.get(replica, 0) + 1
            if strikes < PROBE_STRIKES:
                continue
            del self._strikes[replica]
            waiting = [c for c in silent[replica]
                       if c.replica is replica and not c.parked and c.heard_at <= now]
            _log.warning("scheduler replica stopped answering; moving its streams",
                         replica=replica.address, streams=len(waiting))
            for c in waiting:
                c.stalled = True
                self._on_intervention("replica_stalled")
                c.cut()

    @staticmethod
    async def _answers(replica: Replica) -> bool:
        """Whether the replica's process answers at all (an error status is an answer)."""
        try:
            await replica.stub.Stats(scheduler_pb2.StatsRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return exc.code() not in _NO_ANSWER
        return True

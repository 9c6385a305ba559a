"""The scheduler's end of the executor channel: a ZeroMQ ROUTER on ipc://.

The link only moves typed messages; what they mean is the loop's business. Nothing a
peer sends can stop the reader: a malformed frame, or a Hello with impossible fields or
no valid auth tag (runtime/internal_auth.py), is dropped and counted
(``num_dropped_frames``). A peer that is not the current executor never becomes it
without a valid Hello; its messages get a ``detached`` heartbeat (at most once per
``DETACHED_REPLY_EVERY_S``), which tells a real executor to re-register.

A warm standby's Hello is kept aside; ``promote_standby`` switches to it when the loop
loses its executor, with no process start or model load on the critical path. Plans go
through the peer's shared-memory ring where there is one (scheduler_svc/plan_channel.py),
over ZeroMQ otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio

from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from runtime import internal_auth
from runtime.aio import cancel_all
from runtime.zmq_sockets import release_on_collect
from scheduler_svc.plan_channel import PlanChannel

log = structlog.get_logger("scheduler.link")

DETACHED_REPLY_EVERY_S = 1.0
MAX_FRAME_BYTES = 64 << 20
# Identities remembered for rate limits and log-once; a scan of many identities
# forgets the oldest rather than growing without bound.
MAX_REMEMBERED_PEERS = 1024
# How far a Hello's signing time may be from ours (replays older than this are refused).
HELLO_MAX_SKEW_S = 60.0


class ExecutorLink:
    """Receives executor messages on a background task and hands them to callbacks.

    ``on_hello(identity, hello)`` and ``on_result(result)`` run on the event
    loop; ``last_seen`` is the monotonic time of the latest message from the
    current peer. ``secret`` None (the insecure opt-out) accepts unsigned Hellos.
    ``plan_channel``: "shm" (plans through a shared-memory ring where possible) or "zmq".
    """

    def __init__(
        self,
        address: str,
        on_hello: Callable[[bytes, pb.Hello], None],
        on_result: Callable[[pb.StepResult], None],
        on_lost: Callable[[], None],
        secret: bytes | None = None,
        on_fatal: Callable[[str], None] | None = None,
        plan_channel: str = "auto",
    ) -> None:
        self.address = address
        self.plans = PlanChannel(plan_channel, address, secret)
        self._on_hello = on_hello
        self._on_result = on_result
        self._on_lost = on_lost
        self._on_fatal = on_fatal
        self._secret = secret
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends to a gone peer fail loudly
        self._sock.setsockopt(zmq.LINGER, 0)
        # A result or Hello is kilobytes; a peer that sends more is cut off by zmq
        # before the bytes are held (a real executor never comes near this).
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # Events queue here unread once the link stops; nothing waits for them. A link
        # collected without close() is released by runtime/zmq_sockets.py, not by its context.
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._release = release_on_collect(self, self._ctx, self._sock, self._monitor)
        self._tasks: list[asyncio.Task] = []
        self.peer: bytes | None = None
        self.peer_incarnation = ""
        self.executor_num_sequences = 0
        self.last_seen = 0.0
        self.num_dropped_frames = 0
        self.standby: bytes | None = None  # identity of the warm standby executor
        self.standby_hello: pb.Hello | None = None
        self.standby_last_seen = 0.0
        self._replied: dict[bytes, float] = {}  # identity → last detached reply
        self._refused: dict[bytes, None] = {}  # identities whose bad Hello was logged
        self._seen_hellos: dict[tuple[str, float], None] = {}  # signed Hellos believed

    def start(self) -> None:
        self._sock.bind(self.address)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reader(), name="link.reader"),
                       loop.create_task(self._watch(), name="link.watch")]
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    async def close(self) -> None:
        await cancel_all(self._tasks)
        self._sock.disable_monitor()
        self._release()
        self.plans.close()

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        log.error("executor link task died", task=task.get_name(), error=repr(exc))
        if self._on_fatal is not None:
            self._on_fatal(f"{task.get_name()} died: {exc!r}")

    def send_plan(self, frame: bytes) -> bool:
        """Sends a plan frame (PlanBuilder.frame) to the current peer, through its ring
        or over ZeroMQ; False if it is unreachable."""
        if self.peer is None:
            return False
        in_ring = self.plans.write(frame)
        if in_ring is None:
            return self._send(frame)
        return not in_ring or self._send(wire.RING_BELL)

    def send_heartbeat(self, incarnation: str, last_step_id: int,
                       to: bytes | None = None) -> bool:
        hb = pb.Heartbeat(incarnation=incarnation, sent_at=time.time(), last_step_id=last_step_id)
        offer = self.plans.offer() if to in (None, self.peer) else None
        if offer is not None and incarnation == self.peer_incarnation:
            hb.plan_ring.CopyFrom(offer)
        return self._send(wire.encode_to_executor("heartbeat", hb), to=to)

    def probe_standby(self) -> bool:
        """Heartbeats the standby; False (and it is forgotten) when it is unreachable."""
        if self.standby is None:
            return True
        if self.send_heartbeat(self.standby_hello.incarnation, 0, to=self.standby):
            return True
        self.drop_standby("it is unreachable")
        return False

    def drop_standby(self, why: str) -> pb.Hello | None:
        hello, self.standby, self.standby_hello = self.standby_hello, None, None
        if hello is not None:
            log.error("standby executor dropped", incarnation=hello.incarnation, why=why)
        return hello

    def promote_standby(self) -> pb.Hello | None:
        """Makes the standby the peer (the loop lost its executor); its Hello, or None
        when there is no standby."""
        if self.standby is None:
            return None
        self.peer, hello = self.standby, self.standby_hello
        self.peer_incarnation, self.last_seen = hello.incarnation, time.monotonic()
        self.standby = self.standby_hello = None
        self.plans.renew(hello.incarnation)
        return hello

    def _send(self, frame: bytes, to: bytes | None = None) -> bool:
        to = self.peer if to is None else to
        if to is None:
            return False
        # A non-blocking send on a zmq.asyncio socket does not raise: it returns a future
        # that already holds the outcome (EHOSTUNREACH from ROUTER_MANDATORY for a gone
        # peer, EAGAIN at the high-water mark). Only a send queued behind another would
        # be pending, and every send here is non-blocking, so none is.
        sent = self._sock.send_multipart([to, frame], flags=zmq.NOBLOCK)
        if not sent.done():
            sent.cancel()
            log.warning("executor unreachable", error="send would block")
            return False
        exc = sent.exception()
        if exc is not None:
            log.warning("executor unreachable", error=str(exc))
            return False
        return True

    async def _watch(self) -> None:
        """A peer disconnected: if it was the current executor, it is gone.

        Disconnect events do not name the peer (and a replaced, hung executor
        may disconnect later), so probe the current one: with ROUTER_MANDATORY
        a send to an identity that is no longer connected fails at once."""
        while True:
            await self._monitor.recv_multipart()
            self.probe_standby()
            if self.peer is not None and not self.send_heartbeat(self.peer_incarnation, 0):
                self.peer = None
                self._on_lost()

    async def _reader(self) -> None:
        while True:
            parts = await self._sock.recv_multipart()
            if len(parts) != 2:  # [identity, frame]: anything else is not our protocol
                self._drop(parts[0] if parts else b"", f"{len(parts) - 1} frames, expected 1")
                continue
            identity, frame = parts
            try:
                kind, msg = wire.decode_from_executor(frame)
            except wire.WireError as exc:
                self._drop(identity, str(exc))
                continue
            try:
                self._deliver(identity, kind, msg)
            except Exception as exc:  # a callback's bug must not silence the channel
                self.num_dropped_frames += 1
                log.exception("executor message could not be handled", kind=kind,
                              error=repr(exc))

    def _deliver(self, identity: bytes, kind: str, msg) -> None:
        if kind == "hello":
            problem = self._hello_problem(msg)
            if problem is not None:
                self._refuse(identity, problem)
                return
            if msg.standby and self.peer not in (None, identity):
                self._keep_standby(identity, msg)
                return
            if identity == self.standby:
                self.drop_standby("it registered as the executor")
            self.peer, self.peer_incarnation = identity, msg.incarnation
            self.last_seen = time.monotonic()
            self.plans.renew(msg.incarnation)
            self._on_hello(identity, msg)
        elif identity == self.peer:
            self.last_seen = time.monotonic()
            if kind == "result":
                self._on_result(msg)
            elif kind == "heartbeat":
                self.executor_num_sequences = msg.num_sequences
                if msg.plan_ring_name and msg.incarnation == self.peer_incarnation:
                    self.plans.confirm(msg.plan_ring_name)
        elif identity == self.standby and kind == "heartbeat":
            self.standby_last_seen = time.monotonic()
        else:
            self._tell_detached(identity, msg.incarnation)

    def _keep_standby(self, identity: bytes, hello: pb.Hello) -> None:
        if self.standby not in (None, identity):
            log.warning("a newer standby executor replaces the registered one",
                        old=self.standby_hello.incarnation, new=hello.incarnation)
        self.standby, self.standby_hello = identity, hello
        self.standby_last_seen = time.monotonic()
        log.info("standby executor registered", incarnation=hello.incarnation, pid=hello.pid)
        # Acknowledged, so it stops re-sending its Hello.
        self.send_heartbeat(hello.incarnation, 0, to=identity)

    def _hello_problem(self, hello: pb.Hello) -> str | None:
        problem = wire.hello_problem(hello)
        if problem is None and not internal_auth.check_tag(
                self._secret, wire.hello_payload(hello), hello.auth_tag):
            problem = ("missing auth tag" if not hello.auth_tag else "wrong auth tag") + \
                f" (the executor needs this deployment's {internal_auth.ENV_SECRET})"
        if problem is None and self._secret is not None:
            problem = self._replay_problem(hello)
        return problem

    def _replay_problem(self, hello: pb.Hello) -> str | None:
        """A signed Hello is believed once, and only while fresh: one signed more than
        HELLO_MAX_SKEW_S from now, or seen before, is a recording (or clocks apart)."""
        age = time.time() - hello.sent_at
        if abs(age) > HELLO_MAX_SKEW_S:
            return (f"a Hello signed {age:.0f} s from now (more than {HELLO_MAX_SKEW_S:.0f} s: "
                    "a replayed Hello, or the executor's clock is off)")
        key = (hello.incarnation, hello.sent_at)
        if key in self._seen_hellos:
            return "a replayed Hello (this exact Hello was already received)"
        _remember(self._seen_hellos, key, None)
        return None

    def _drop(self, identity: bytes, why: str) -> None:
        self.num_dropped_frames += 1
        log.warning("dropped executor frame", identity=identity.hex()[:16], error=why)

    def _refuse(self, identity: bytes, why: str) -> None:
        """A Hello that is not believed: counted always, logged once per identity."""
        self.num_dropped_frames += 1
        if identity not in self._refused:
            _remember(self._refused, identity, None)
            log.error("executor hello refused", identity=identity.hex()[:16], error=why)

    def _tell_detached(self, identity: bytes, incarnation: str) -> None:
        """A non-peer sent a result or heartbeat of ``incarnation``: say it is not
        registered (rate-limited per identity)."""
        now = time.monotonic()
        if now - self._replied.get(identity, -DETACHED_REPLY_EVERY_S) < DETACHED_REPLY_EVERY_S:
            return
        _remember(self._replied, identity, now)
        hb = pb.Heartbeat(incarnation=incarnation, sent_at=time.time(), detached=True)
        self._send(wire.encode_to_executor("heartbeat", hb), to=identity)


def _remember(seen: dict, key: bytes, value) -> None:
    seen.pop(key, None)
    seen[key] = value
    while len(seen) > MAX_REMEMBERED_PEERS:
        del seen[next(iter(seen))]

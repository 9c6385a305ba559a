"""The executor's end of the scheduler channel, and the loop that serves it.

A zmq DEALER connects to the scheduler's ROUTER (ipc://); each frame is one message of
protos/wire.py. The loop alone owns the Runner and answers in arrival order.

Hello goes out at every (re)connect (a restarted scheduler knows nobody), again after
``hello_retry_s`` without answer, or when a heartbeat names another incarnation; the
scheduler treats every Hello as an empty executor, so it drops this executor's sequence
state. A ``detached`` heartbeat makes it re-register at once. Every Hello is signed
(``auth_tag``, runtime/internal_auth.py); undecodable frames are dropped and counted.

Plans may come through a shared-memory ring (runtime/plan_ring.py) offered in a
heartbeat: the loop attaches it, names it in its heartbeats, spins on it a moment after
each plan, then sleeps on ZeroMQ until a ``ring_bell``. Every Hello drops the ring.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from executor_svc.runner import Runner
from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from runtime import internal_auth, plan_ring
from runtime.zmq_sockets import release_on_collect

log = logging.getLogger("executor.link")
CONNECTED = "connected"  # what recv() returns when the connection is (re)established
JUNK = "junk"  # ... when a message had more parts than the protocol's one frame


class SchedulerLink:
    """Blocking DEALER socket (one frame per message) plus a monitor for (re)connections."""

    def __init__(self, address: str, linger_ms: int = 200) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._release = release_on_collect(self, self._ctx, self._sock, self._monitor)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(address)

    def send(self, kind: str, msg) -> None:
        self._sock.send(wire.encode_to_scheduler(kind, msg))

    def pending(self) -> bool:
        """A message (or a connection event) is waiting: a spin on the plan ring stops."""
        return bool(self._sock.poll(0) or self._monitor.poll(0))

    def recv(self, timeout_ms: int) -> bytes | str | None:
        """The next payload, CONNECTED after a (re)connection, or None after ``timeout_ms``."""
        ready = dict(self._poller.poll(timeout_ms))
        if self._monitor in ready:
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                return CONNECTED
        if self._sock in ready:
            # A ROUTER peer may prepend an empty delimiter; the payload is the last frame.
            parts = self._sock.recv_multipart()
            if len(parts) == 1 or (len(parts) == 2 and not parts[0]):
                return parts[-1]
            return JUNK
        return None

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close()  # its own linger: the last result may still be on its way
        self._release()


class ServeLoop:
    """Receives plans and heartbeats until ``should_stop()``; polls so signals are prompt."""

    def __init__(
        self,
        link: SchedulerLink,
        runner: Runner,
        hello: pb.Hello,
        should_stop: Callable[[], bool],
        hello_retry_s: float = 2.0,
        poll_ms: int = 100,
        secret: bytes | None = None,
        renew_incarnation: bool = True,
        on_hello: Callable[[str], None] | None = None,
    ) -> None:
        """``secret``: signs every Hello (None: the insecure opt-out). ``renew_incarnation``
        False keeps the incarnation on re-registration (tensor-parallel ranks check it).
        ``on_hello``: called with the incarnation each Hello names, before it is sent."""
        self.link, self.runner, self.hello = link, runner, hello
        self.on_hello = on_hello
        self.secret = secret
        self.renew_incarnation = renew_incarnation
        self.num_dropped_frames = 0
        self.should_stop = should_stop
        self.hello_retry_s = hello_retry_s
        self.poll_ms = poll_ms
        self._answered = False  # anything received since the last Hello
        self._retried = False
        self._last_hello = 0.0
        self._received_at = 0.0  # perf_counter when the frame being handled arrived
        self._result_sent_at = 0.0  # ... when the last result went out (0: none since Hello)
        self.plans: plan_ring.PlanRingReader | None = None  # the scheduler's plan ring
        self._offered = ""  # the ring last offered: attached (or tried) once
        self._spin = False  # a plan was just handled: the next one is likely close
        self._spin_s = plan_ring.spin_budget()  # how long that spin may last here

    def run(self) -> None:
        try:
            self._run()
        finally:
            self._drop_ring()

    def _run(self) -> None:
        while not self.should_stop():
            if self.plans is not None and self._serve_ring():
                continue
            frame = self.link.recv(self.poll_ms)
            if self.plans is not None:
                self.plans.awake()
                if frame == wire.RING_BELL:  # a plan waits in the ring: read it at once
                    self._answered = True
                    self._drain_ring()
                    continue
            if frame == CONNECTED:
                self._send_hello("connected")
            elif frame == JUNK:
                self._drop("a message of more than one frame")
            elif frame is None:
                if self._last_hello and not self._answered and not self._retried \
                        and self._since_hello() >= self.hello_retry_s:
                    self._retried = True
                    # A scheduler drops a Hello it cannot verify without a word.
                    self._send_hello("no answer yet: if none comes, check that this "
                                     "executor has the scheduler's internal secret")
            else:
                self._receive(frame)

    def _serve_ring(self) -> bool:
        """Runs the ring's next plan if one comes within the spin; False: wait on ZeroMQ."""
        try:
            payload = self.plans.wait(self._spin_s if self._spin else 0.0,
                                      self.link.pending)
        except plan_ring.FrameError as exc:
            self._drop(str(exc))
            return True
        if payload is None:
            self._spin = False
            return False
        self._receive(payload, from_ring=True)
        return True

    def _receive(self, frame: bytes, from_ring: bool = False) -> None:
        self._received_at = time.perf_counter()
        try:
            kind, msg = wire.decode_from_scheduler(frame)
        except wire.WireError as exc:
            self._drop(str(exc))
            return
        self._answered = True
        if kind == "plan" and not from_ring and self.plans is not None:
            self._drain_ring()  # its frames written before this plan went over ZeroMQ
            self.plans.received_over_zmq()
        self.handle(kind, msg)

    def _drain_ring(self) -> None:
        while self.plans is not None:
            try:
                payload = self.plans.poll()
            except plan_ring.FrameError as exc:
                self._drop(str(exc))
                continue
            if payload is None:
                return
            self._receive(payload, from_ring=True)

    def _attach_ring(self, offer: pb.PlanRing) -> None:
        """Attaches the offered ring once (a failure leaves the plans on ZeroMQ)."""
        self._offered = offer.name
        self._drop_ring()
        try:
            self.plans = plan_ring.PlanRingReader(offer.name, offer.generation, offer.key,
                                                  self.secret, self.hello.incarnation)
        except (OSError, ValueError) as exc:
            log.warning("cannot read the scheduler's plan ring %s (%s): plans over ZeroMQ",
                        offer.name, exc)
            return
        log.info("plans through the scheduler's shared-memory ring %s", offer.name)

    def _drop_ring(self) -> None:
        if self.plans is not None:
            self.plans.close()
            self.plans = None

    def handle(self, kind: str, msg) -> None:
        if kind == "plan":
            result = self.runner.execute(msg)
            if self._result_sent_at:
                result.idle_ms = max(0.0, self._received_at - self._result_sent_at) * 1e3
            self.link.send("result", result)
            self._result_sent_at = time.perf_counter()
            self._spin = True
            log.debug("step %d: %d sampled, %.1f ms", msg.step_id, len(result.token_ids),
                      result.step_ms)
        elif kind == "heartbeat":
            if msg.detached:
                # It names the incarnation it answers: echoes of one already renewed
                # (messages sent before the new Hello) are old news.
                if msg.incarnation in ("", self.hello.incarnation):
                    self._send_hello("the scheduler detached this executor", renew=True)
                return
            if msg.incarnation != self.hello.incarnation and self._since_hello() >= 1.0:
                self._send_hello(f"scheduler knows incarnation {msg.incarnation!r}")
            elif msg.HasField("plan_ring") and msg.incarnation == self.hello.incarnation \
                    and msg.plan_ring.name != self._offered:
                self._attach_ring(msg.plan_ring)
            self.link.send("heartbeat", pb.Heartbeat(
                incarnation=self.hello.incarnation,
                sent_at=time.time(),
                last_step_id=self.runner.last_step_id,
                num_sequences=len(self.runner.seqs),
                plan_ring_name=self.plans.name if self.plans is not None else "",
            ))

    def _since_hello(self) -> float:
        return time.monotonic() - self._last_hello

    def _drop(self, why: str) -> None:
        self.num_dropped_frames += 1
        if self.num_dropped_frames <= 10 or self.num_dropped_frames % 1000 == 0:
            log.warning("dropped frame #%d: %s", self.num_dropped_frames, why)

    def _send_hello(self, why: str, renew: bool = False) -> None:
        self._result_sent_at = 0.0
        self._drop_ring()  # the scheduler offers a fresh one to the registration
        self._offered = ""
        if renew and self.renew_incarnation:
            self.hello.incarnation = uuid.uuid4().hex
            self.runner.reset(self.hello.incarnation)
        else:
            self.runner.reset()
        if self.on_hello is not None:
            self.on_hello(self.hello.incarnation)
        self.hello.ClearField("auth_tag")
        self.hello.sent_at = time.time()  # signed: a recorded Hello goes stale
        if self.secret is not None:
            self.hello.auth_tag = internal_auth.tag(self.secret, wire.hello_payload(self.hello))
        self.link.send("hello", self.hello)
        self._last_hello = time.monotonic()
        self._answered = False
        log.info("hello sent (%s), incarnation %s", why, self.hello.incarnation)


class IncarnationFile:
    """``--incarnation-file``: the incarnation of this executor's latest Hello, for a probe
    of its own (deploy/probe.py executor --incarnation-file): whether the scheduler holds
    this process in service or as its standby. Written whole (a temporary file renamed
    over it); removed when the executor stops. A file that cannot be written is logged,
    never fatal: the probe then fails, which is the right signal."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, incarnation: str) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(incarnation + "\n")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot write the incarnation file %s: %s", self.path, exc)

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass

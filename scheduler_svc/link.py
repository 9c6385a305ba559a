"""The scheduler's end of the executor channel: a ZeroMQ ROUTER on ipc://.

Executors connect DEALER sockets and introduce themselves with ``Hello``.
The link only moves typed messages; what they mean is the loop's business.
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

log = structlog.get_logger("scheduler.link")


class ExecutorLink:
    """Receives executor messages on a background task and hands them to callbacks.

    ``on_hello(identity, hello)`` and ``on_result(result)`` run on the event
    loop; ``last_seen`` is the monotonic time of the latest message from the
    current peer.
    """

    def __init__(
        self,
        address: str,
        on_hello: Callable[[bytes, pb.Hello], None],
        on_result: Callable[[pb.StepResult], None],
        on_lost: Callable[[], None],
    ) -> None:
        self.address = address
        self._on_hello = on_hello
        self._on_result = on_result
        self._on_lost = on_lost
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends to a gone peer fail loudly
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks: list[asyncio.Task] = []
        self.peer: bytes | None = None
        self.peer_incarnation = ""
        self.executor_num_sequences = 0
        self.last_seen = 0.0

    def start(self) -> None:
        self._sock.bind(self.address)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reader()), loop.create_task(self._watch())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    def send_plan(self, msg: pb.SchedulerMessage) -> bool:
        """Sends a plan frame (plan.build_plan_message) to the current peer; False if
        it is unreachable."""
        return self._send(msg.SerializeToString())

    def send_heartbeat(self, incarnation: str, last_step_id: int) -> bool:
        hb = pb.Heartbeat(incarnation=incarnation, sent_at=time.time(), last_step_id=last_step_id)
        return self._send(wire.encode_to_executor("heartbeat", hb))

    def _send(self, frame: bytes) -> bool:
        if self.peer is None:
            return False
        # A non-blocking send on a zmq.asyncio socket does not raise: it returns a future
        # that already holds the outcome (EHOSTUNREACH from ROUTER_MANDATORY for a gone
        # peer, EAGAIN at the high-water mark). Only a send queued behind another would
        # be pending, and every send here is non-blocking, so none is.
        sent = self._sock.send_multipart([self.peer, frame], flags=zmq.NOBLOCK)
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
            if self.peer is not None and not self.send_heartbeat(self.peer_incarnation, 0):
                self.peer = None
                self._on_lost()

    async def _reader(self) -> None:
        while True:
            identity, frame = await self._sock.recv_multipart()
            try:
                kind, msg = wire.decode_from_executor(frame)
            except wire.WireError as exc:
                log.error("dropped executor frame", error=str(exc))
                continue
            if kind == "hello":
                self.peer, self.peer_incarnation = identity, msg.incarnation
                self.last_seen = time.monotonic()
                self._on_hello(identity, msg)
            elif identity == self.peer:
                self.last_seen = time.monotonic()
                if kind == "result":
                    self._on_result(msg)
                elif kind == "heartbeat":
                    self.executor_num_sequences = msg.num_sequences

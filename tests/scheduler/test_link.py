"""ExecutorLink's sends report what happened: a plan to a gone peer is not 'sent'."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.link import ExecutorLink


def _plan() -> bytes:
    msg = pb.SchedulerMessage(schema_version=wire.SCHEMA_VERSION)
    msg.plan.incarnation, msg.plan.step_id = "inc", 1
    return msg.SerializeToString()


def test_send_to_unknown_peer_fails(tmp_path) -> None:
    async def go() -> bool:
        link = ExecutorLink(f"ipc://{tmp_path}/s.sock", lambda *a: None, lambda r: None,
                            lambda: None)
        link.start()
        try:
            link.peer = b"no-such-executor"  # ROUTER_MANDATORY: EHOSTUNREACH
            return link.send_plan(_plan())
        finally:
            await link.close()

    assert asyncio.run(go()) is False


def test_send_to_connected_peer_arrives(tmp_path) -> None:
    address = f"ipc://{tmp_path}/s.sock"

    async def go() -> tuple[bool, bytes]:
        link = ExecutorLink(address, lambda *a: None, lambda r: None, lambda: None)
        link.start()
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"exec-1")
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        try:
            link.peer = b"exec-1"
            for _ in range(200):  # the connection is asynchronous: wait until routable
                if link.send_plan(_plan()):
                    break
                await asyncio.sleep(0.01)
            else:
                return False, b""
            frame = await asyncio.wait_for(dealer.recv(), 5)
            return True, frame
        finally:
            dealer.close(linger=0)
            ctx.term()
            await link.close()

    ok, frame = asyncio.run(go())
    assert ok
    kind, msg = wire.decode_from_scheduler(frame)
    assert kind == "plan" and msg.step_id == 1

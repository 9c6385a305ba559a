"""A raw zmq DEALER that speaks (or abuses) the executor protocol to a real scheduler link.

No model: ``answer`` samples a deterministic token for every sequence a plan completes,
keeping per-sequence token counts the way the real executor does (decode plans carry no
token ids). Tests use it to inject junk frames, forged Hellos and malformed results.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import grpc
import zmq
import zmq.asyncio

from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import scheduler_pb2_grpc
from runtime import internal_auth
from runtime.zmq_sockets import release_on_collect
from scheduler_svc.core import SchedulerConfig
from scheduler_svc.link import ExecutorLink
from scheduler_svc.loop import EngineLoop
from scheduler_svc.servicer import SchedulerServicer

SECRET = b"fake-peer-test-secret-0123456789"
VOCAB = 1000


def make_hello(secret: bytes | None = SECRET, **fields) -> pb.Hello:
    hello = pb.Hello(schema_version=wire.SCHEMA_VERSION, incarnation=uuid.uuid4().hex,
                     model_id="fake", dtype="float32", block_size=4, num_device_blocks=64,
                     tp_size=1, max_model_len=256, vocab_size=VOCAB, eos_token_ids=[2],
                     prefill_tokens_per_s=1e4, pid=1, sent_at=time.time())
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(hello, name)[:] = value
        else:
            setattr(hello, name, value)
    if secret is not None:
        hello.auth_tag = internal_auth.tag(secret, wire.hello_payload(hello))
    return hello


class FakePeer:
    def __init__(self, address: str, identity: bytes | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self._release = release_on_collect(self, self.ctx, self.sock)
        self.sock.connect(address)
        self.seqs: dict[int, list[int]] = {}  # seq_id → [num tokens, num computed]
        self.hello: pb.Hello | None = None

    async def send(self, kind: str, msg) -> None:
        await self.sock.send(wire.encode_to_scheduler(kind, msg))

    async def send_raw(self, *frames: bytes) -> None:
        await self.sock.send_multipart(list(frames))

    async def say_hello(self, hello: pb.Hello) -> None:
        self.hello = hello
        await self.send("hello", hello)

    async def recv(self, timeout: float = 10.0):
        frame = await asyncio.wait_for(self.sock.recv(), timeout)
        return wire.decode_from_scheduler(frame)

    async def next_plan(self, timeout: float = 10.0) -> pb.BatchPlan:
        while True:
            kind, msg = await self.recv(timeout)
            if kind == "plan":
                return msg

    def answer(self, plan: pb.BatchPlan) -> pb.StepResult:
        """What a healthy executor would answer (token = 100 + seq_id + position); like
        the real one it refuses, changing nothing, a plan naming a sequence it lacks."""
        held = self.seqs.keys() - set(plan.finished_seq_ids)
        cached = wire.plan_cached_seq_ids(plan)
        if not set(cached) <= held:
            return pb.StepResult(incarnation=plan.incarnation, step_id=plan.step_id,
                                 error_code=pb.STEP_ERROR_CODE_UNKNOWN_SEQUENCE)
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        work = [(n.seq_id, n.num_scheduled_tokens) for n in plan.new_seqs]
        for n in plan.new_seqs:
            self.seqs[n.seq_id] = [len(n.token_ids), n.num_computed_tokens]
        work += zip(cached, plan.cached_num_scheduled_tokens, strict=True)
        result = pb.StepResult(incarnation=plan.incarnation, step_id=plan.step_id)
        for seq_id, n in work:
            state = self.seqs[seq_id]
            state[1] += n
            if state[1] >= state[0]:
                result.seq_ids.append(seq_id)
                result.token_ids.append(100 + seq_id + state[0])
                state[0] += 1
        return result

    async def serve(self, steps: int = 1_000_000, timeout: float = 10.0) -> None:
        """Answers plans (and heartbeats) until cancelled."""
        for _ in range(steps):
            kind, msg = await self.recv(timeout)
            if kind == "plan":
                await self.send("result", self.answer(msg))
            elif kind == "heartbeat" and self.hello is not None:
                await self.send("heartbeat", pb.Heartbeat(incarnation=self.hello.incarnation))

    def close(self) -> None:
        """Idempotent: a test closes a peer to kill it, its fixture closes it again."""
        self._release()


@contextlib.asynccontextmanager
async def linked_peers(address: str, *identities: bytes | None):
    """A started ExecutorLink on ``address`` (secret SECRET) that records the Hellos it
    believes, and one FakePeer per identity (None: zmq's own) connected to it:
    ``(link, hellos, peers)``; all closed on exit."""
    hellos: list[pb.Hello] = []
    link = ExecutorLink(address, lambda identity, hello: hellos.append(hello),
                        lambda result: None, lambda: None, secret=SECRET)
    link.start()
    peers = [FakePeer(address, identity=identity) for identity in identities]
    try:
        yield link, hellos, peers
    finally:
        for peer in peers:
            peer.close()
        await link.close()


async def settled(condition, timeout_s: float = 2.0) -> bool:
    """Polls ``condition`` every 10 ms until it holds (True) or ``timeout_s`` passes
    (False): the test asserts what it waited for."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


@contextlib.asynccontextmanager
async def served(tmp_path, executor: bool = True, interceptors=(), **config):
    """(loop, stub, address, server): a real engine loop (``config``) behind the Scheduler
    servicer on a real loopback port (``address``; ``interceptors``: the server's), the
    loop stepped by a FakePeer (``executor``: False, none attached: nothing runs)."""
    address = f"ipc://{tmp_path}/s.sock"
    loop = EngineLoop(SchedulerConfig(watermark=0.0, **config), address, secret=SECRET)
    loop.start()
    server = grpc.aio.server(interceptors=list(interceptors))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(loop), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    peer = FakePeer(address)
    serving = None
    try:
        if executor:
            await peer.say_hello(make_hello())
            serving = asyncio.create_task(peer.serve())
            await settled(lambda: loop.executor is not None, 5.0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield (loop, scheduler_pb2_grpc.SchedulerStub(channel), f"127.0.0.1:{port}",
                   server)
    finally:
        while serving is not None and not serving.done():
            # Again until it ends: Python 3.11's wait_for (in FakePeer.recv) can swallow
            # a cancellation that arrives as its receive completes.
            serving.cancel()
            await asyncio.wait([serving], timeout=0.1)
        if serving is not None and not serving.cancelled():
            serving.exception()  # retrieved: a fake executor's end is not the test's
        peer.close()
        await server.stop(0)
        await loop.stop()

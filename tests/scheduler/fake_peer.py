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

import zmq
import zmq.asyncio

from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from runtime import internal_auth
from runtime.zmq_sockets import release_on_collect
from scheduler_svc.link import ExecutorLink

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

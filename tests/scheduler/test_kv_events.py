"""The KV event stream (scheduler_svc/kv_events.py) as llm-d's scorer would read it.

A real engine loop against a fake executor (tests/scheduler/fake_peer.py) on a real ipc
socket publishes on loopback TCP; a real ZeroMQ SUB decodes every batch with vLLM's own
schema (msgspec structs declared as vLLM declares them, in the current and in the older
six-field form), fills gaps from the replay socket, and rebuilds the prefix index. After
shared prefixes, evictions and preemptions, the rebuilt index equals the block
manager's; a lost executor, a new one and a resync each clear it (the core's records).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from continuum.serve.procs import free_port
from scheduler_svc.core import SchedulerConfig
from scheduler_svc.core.kv_events import KVEventLog
from scheduler_svc.kv_events import KVEventPublisher, endpoint_problem
from scheduler_svc.loop import EngineLoop
from tests.scheduler.factories import fake_execute, make_model, make_request, make_scheduler
from tests.scheduler.fake_peer import SECRET, FakePeer, make_hello
from tests.scheduler.test_engine_faults import drain

TOPIC = "kv@pod-a@fake-model"
BLOCK_SIZE = 4  # make_hello's


# vLLM's wire schema (vllm/distributed/kv_events.py), declared here as a consumer does.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                   tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class OldBlockStored(KVCacheEvent, tag="BlockStored"):  # vLLM's example subscriber's
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldKVEventBatch(EventBatch):
    events: list[OldBlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """Rebuilds a replica's prefix index from its stream: hash → block tokens."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "kv@")
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(replay)
        self.index: dict[int, tuple[int, ...]] = {}
        self.next_seq = 0
        self.kinds: set[str] = set()
        self.num_replayed = 0
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._decode_old = msgspec.msgpack.Decoder(OldKVEventBatch).decode

    async def pump(self, timeout_s: float) -> None:
        """Applies what arrives within ``timeout_s``; a gap is filled by replay."""
        while await self.sub.poll(timeout_s * 1000):
            topic, seq_bytes, payload = await self.sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                await self.catch_up()
            if seq == self.next_seq:
                self.apply(seq, payload)
            timeout_s = 0

    async def catch_up(self) -> None:
        """Asks the replay socket for everything from ``next_seq`` on."""
        await self.replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            empty, seq_bytes, payload = await asyncio.wait_for(
                self.replay.recv_multipart(), 10)
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return
            if seq == self.next_seq:
                self.apply(seq, payload)
                self.num_replayed += 1

    def apply(self, seq: int, payload: bytes) -> None:
        raw = msgspec.msgpack.decode(payload)  # llm-d's view: arrays, the tag first
        assert isinstance(raw, list) and raw[2] == 0
        assert all(isinstance(e, list) and isinstance(e[0], str) for e in raw[1])
        batch = self._decode(payload)
        old = self._decode_old(payload)  # older decoders skip the fields they lack
        assert [type(e).__name__ for e in old.events] == [
            ("Old" if isinstance(e, BlockStored) else "") + type(e).__name__
            for e in batch.events]
        for event in batch.events:
            self.kinds.add(type(event).__name__)
            if isinstance(event, BlockStored):
                assert event.block_size == BLOCK_SIZE and event.medium == "GPU"
                assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
                parent = event.parent_block_hash or 0
                for i, h in enumerate(event.block_hashes):
                    tokens = tuple(event.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
                    assert h == hash((parent, tokens)), "the hash chain is not the tokens'"
                    self.index[h] = tokens
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert self.index.pop(h, None) is not None, "removed what was not stored"
            else:
                self.index.clear()
        self.next_seq = seq + 1

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


def _prompt(prefix: int, suffix: int, n: int) -> list[int]:
    """Three shared blocks per ``prefix`` family, then a distinct tail."""
    return [500 + prefix * 20 + i for i in range(12)] + [900 + suffix + i for i in range(n)]


async def _run_batch(loop: EngineLoop, prompts: list[list[int]], max_tokens: int) -> None:
    queues = []
    for tokens in prompts:
        req = make_request(prompt_len=len(tokens), max_tokens=max_tokens)
        req.token_ids[:] = tokens
        queues.append(loop.submit(req))
    for queue in queues:
        await drain(queue)


async def _converged(sub: Subscriber, loop: EngineLoop) -> None:
    for _ in range(400):
        await sub.pump(0.05)
        if sub.index == loop.core.block_manager.indexed_blocks():
            return
    await sub.catch_up()
    assert sub.index == loop.core.block_manager.indexed_blocks()


def test_a_subscriber_rebuilds_the_prefix_index_through_eviction_and_preemption(
        tmp_path):
    async def go():
        address = f"ipc://{tmp_path}/s.sock"
        loop = EngineLoop(SchedulerConfig(watermark=0.0, max_num_seqs=4,
                                          max_num_batched_tokens=64, chunk_size=32),
                          address, secret=SECRET)
        port, replay_port = free_port(), free_port()
        publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", topic=TOPIC,
                                     replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
        publisher.attach(loop.core)
        ctx = zmq.asyncio.Context()
        sub = Subscriber(ctx, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
        loop.start()
        peer = FakePeer(address)
        server = asyncio.create_task(peer.serve())
        try:
            # 16 blocks of 4: four sequences of 14 + 18 tokens need 32, so the pool
            # preempts; finished ones stay cached and are evicted for the next.
            await peer.say_hello(make_hello(num_device_blocks=16))
            await _run_batch(loop, [_prompt(0, 0, 2), _prompt(0, 10, 2), _prompt(1, 20, 2),
                                    _prompt(0, 30, 2)], max_tokens=18)
            await _run_batch(loop, [_prompt(2, 40, 5), _prompt(0, 50, 1)], max_tokens=6)
            await _converged(sub, loop)
            assert loop.core.num_preemptions > 0
            assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= sub.kinds
            assert sub.index  # prefixes are still cached at the end
            assert loop.core.block_manager.num_cache_hits > 0  # a shared prefix was reused

            assert sub.next_seq > 0 and publisher.num_dropped == 0
            late = Subscriber(ctx, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
            await late.catch_up()  # joined after everything: the replay socket has it all
            late.close()
            assert late.next_seq == sub.next_seq and late.index == sub.index
        finally:
            server.cancel()
            peer.close()
            sub.close()
            await loop.stop()
            publisher.close()
            ctx.term()

    asyncio.run(go())


def test_a_full_queue_drops_and_counts_and_leaves_a_sequence_gap():
    class Core:  # what attach reads of a Scheduler
        kv_events: KVEventLog | None = None

    async def go():
        core = Core()
        publisher = KVEventPublisher("inproc://kv-drop-test", max_queue=1)
        publisher.attach(core)
        publisher.close()  # its thread stops: nothing drains the queue any more
        publisher._queue.put_nowait((0, 0.0, []))  # full
        core.kv_events.removed([1, 2])
        core.kv_events.removed([3])
        publisher.flush()
        assert publisher.num_dropped == 2  # records, counted on the page
        assert publisher._next_seq == 1  # the dropped batch's number is spent: a gap

    asyncio.run(go())


@pytest.mark.parametrize("endpoint,allowed", [
    ("tcp://127.0.0.1:5557", True), ("tcp://[::1]:5557", True), ("ipc:///tmp/kv", True),
    ("tcp://*:5557", False), ("tcp://0.0.0.0:5557", False), ("tcp://10.0.0.5:5557", False),
    ("http://127.0.0.1:5557", False), ("5557", False)])
def test_only_loopback_binds_without_the_opt_in(endpoint, allowed):
    assert (endpoint_problem(endpoint, allow_remote=False) is None) == allowed
    if endpoint.startswith("tcp://"):
        assert endpoint_problem(endpoint, allow_remote=True) is None


def test_a_lost_executor_a_new_one_and_a_resync_each_clear_the_index():
    core = make_scheduler(num_blocks=8)
    core.kv_events = log = KVEventLog()
    core.attach_executor(make_model(num_blocks=8))  # a new, empty pool
    assert log.take() == [("cleared",)]
    req = make_request(prompt_len=9, max_tokens=1)
    core.add_request(req)
    out = core.schedule()
    core.update(out, *fake_execute(out))
    stored = log.take()
    assert [r[0] for r in stored] == ["stored"] and stored[0][1] == req.block_hashes[:2]
    assert stored[0][2] is None and stored[0][3] == req.token_ids[:8] and stored[0][4] == 4
    core.resync()
    core.detach_executor()
    assert log.take() == [("cleared",), ("cleared",)]

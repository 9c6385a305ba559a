"""vLLM's KV event stream (ZeroMQ PUB), for prefix-aware routers such as llm-d's.

llm-d's precise prefix-cache scorer subscribes to every model-server pod and keeps an
index of which pod holds which prefix blocks; it reads vLLM's stream unmodified, so this
is that stream, frame for frame (vllm/distributed/kv_events.py, ZmqEventPublisher):

* a multipart message ``[topic, seq, payload]`` per batch: ``topic`` as configured
  (llm-d parses ``kv@<pod>@<model>``), ``seq`` an 8-byte big-endian batch number,
  ``payload`` a msgpack ``KVEventBatch``: the array ``[ts, events, data_parallel_rank]``;
* each event a msgspec tagged array: ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name]``, ``["BlockRemoved",
  block_hashes, medium]`` or ``["AllBlocksCleared"]`` (decoders of older vLLM schemas
  ignore the trailing fields they lack);
* optionally a ROUTER replay socket: a request ``[identity, b"", start_seq]`` is
  answered with every buffered ``[b"", seq, payload]`` from ``start_seq`` on, then
  ``[b"", seq = -1, b""]``.

What the hashes are and why they are stable: scheduler_svc/core/kv_events.py.

Off the step path: after each step the log's records go, as one batch, into a bounded
queue a thread encodes and sends. A full queue drops the batch and counts its events
(``continuum:kv_events_dropped_total``); its sequence number is still spent, so a
subscriber sees the gap. PUB has no authentication: the endpoint must be loopback,
ipc:// or inproc:// unless ``allow_remote`` (``--kv-events-allow-remote``).
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
import urllib.parse
from typing import Any

import msgspec
import structlog
import zmq

from scheduler_svc.core.kv_events import KVEventLog, KVRecord

log = structlog.get_logger("scheduler.kv_events")

MEDIUM_GPU = "GPU"  # vLLM's name for the device pool, whatever the device
END_SEQ = (-1).to_bytes(8, "big", signed=True)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                   tag=True):
    """vLLM's event base: encoded as ``[class name, *fields]``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_event(record: KVRecord) -> KVCacheEvent:
    kind = record[0]
    if kind == "stored":
        _, hashes, parent, tokens, block_size = record
        return BlockStored(hashes, parent, tokens, block_size, None, MEDIUM_GPU, None)
    if kind == "removed":
        return BlockRemoved(record[1], MEDIUM_GPU)
    return AllBlocksCleared()


def endpoint_problem(endpoint: str, allow_remote: bool) -> str | None:
    """Why ``endpoint`` may not be bound (None: it may)."""
    url = urllib.parse.urlsplit(endpoint)
    if url.scheme in ("ipc", "inproc"):
        return None
    if url.scheme != "tcp" or not url.netloc:
        return f"{endpoint!r} is not a ZeroMQ endpoint like tcp://127.0.0.1:5557"
    host = url.netloc.rsplit(":", 1)[0].strip("[]")
    if host not in LOOPBACK_HOSTS and not allow_remote:
        return (f"{endpoint} is not on loopback and the KV event stream has no "
                "authentication; pass --kv-events-allow-remote where a NetworkPolicy "
                "lets only routers reach the port")
    return None


class KVEventPublisher:
    """Publishes a Scheduler core's KV events; ``attach`` before any executor attaches.

    ``connect`` connects the PUB to a subscriber that binds (llm-d's central indexer)
    instead of binding it. ``close`` sends what is queued (bounded wait) and stops."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str = "",
                 connect: bool = False, allow_remote: bool = False,
                 max_queue: int = 10_000, buffer_steps: int = 10_000,
                 hwm: int = 100_000) -> None:
        for where in filter(None, (None if connect else endpoint, replay_endpoint)):
            problem = endpoint_problem(where, allow_remote)
            if problem is not None:
                raise ValueError(problem)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            (self._pub.connect if connect else self._pub.bind)(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._topic = topic.encode()
        self._queue: queue.Queue[tuple[int, float, list[KVRecord]] | None] = \
            queue.Queue(max_queue)
        self._buffer: collections.deque[tuple[int, bytes]] = \
            collections.deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._log: KVEventLog | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_pending = False
        self.num_sent = 0  # batches (the thread's count)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def attach(self, core, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Makes ``core`` record its index changes (Scheduler.kv_events) for us."""
        self._loop = loop or asyncio.get_running_loop()
        self._log = core.kv_events = KVEventLog(on_first=self._schedule_flush)

    @property
    def num_dropped(self) -> int:
        return self._log.num_dropped if self._log is not None else 0

    def _schedule_flush(self) -> None:
        if not self._flush_pending:  # once per step: the step is being built now
            self._flush_pending = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Queues what the core recorded as one batch (on the loop, never blocking)."""
        self._flush_pending = False
        records = self._log.take()
        if not records:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), records))
        except queue.Full:
            self._log.num_dropped += len(records)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, records = item
            payload = encoder.encode(KVEventBatch(ts, [to_event(r) for r in records], 0))
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload))
            except zmq.ZMQError as exc:  # a closed socket at shutdown; never fatal
                log.warning("could not publish KV events", error=str(exc))
                continue
            self._buffer.append((seq, payload))
            self.num_sent += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV event replay request", frames=len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))

    def close(self, timeout_s: float = 2.0) -> None:
        if self._log is not None and self._loop is not None:
            self.flush()
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

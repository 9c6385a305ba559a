"""This gateway's requests to one replica, as streams of one SubmitMany call.

Why one call, and the stream and rotation contract: docs/grpc.md, "Inside: how a gateway
calls a scheduler". To the relay a request is a ``SchedulerStream``: ``read()`` returns its
TokenEvents, the last with a finish reason, or a ``StreamEnd`` (the scheduler's status, the
call's break, or the deadline kept here); ``cancel()`` aborts it upstream and makes a
pending ``read()`` raise CancelledError. The call carries the internal secret in its own
metadata (an intercepted bidi call would turn writes into a request iterator)."""

from __future__ import annotations

import asyncio
import collections
import itertools

import grpc
import structlog

from gateway.routing.upstream import StreamEnd
from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc
from runtime.aio import cancel_all

_log = structlog.get_logger("gateway.mux")
_CODES = {code.value[0]: code for code in grpc.StatusCode}
# What ``read()`` returns after a finish (the relay stops reading before).
FINISHED = StreamEnd(grpc.StatusCode.OK, "finished")
_EARLY = StreamEnd(grpc.StatusCode.UNAVAILABLE,
                   "the scheduler ended the call before the stream finished")


def _stream_end(error: scheduler_pb2.StreamError) -> StreamEnd:
    code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    if code is grpc.StatusCode.OK:
        code = grpc.StatusCode.UNKNOWN
    return StreamEnd(code, error.message, tuple(sorted(error.trailers.items())))


class SchedulerStream:
    """One request on a SubmitMany call (see the module docstring)."""

    __slots__ = ("_link", "_id", "_items", "_waiter", "_timer", "done")

    def __init__(self, link: _Link, stream_id: int, timeout: float | None) -> None:
        self._link, self._id = link, stream_id
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.done = False  # its end is in ``_items``: nothing more comes, or is sent
        self._timer = None if timeout is None else asyncio.get_running_loop().call_later(
            max(0.0, timeout), self._expire)

    async def read(self) -> scheduler_pb2.TokenEvent | StreamEnd:
        """Its next TokenEvent, or how it ended (every later read returns that again);
        raises CancelledError once cancelled."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items[0]
        if item.__class__ is StreamEnd:
            return item
        if isinstance(item, BaseException):
            raise item
        self._items.popleft()
        return item

    def cancel(self) -> bool:
        """Aborts it upstream (idempotent); a pending read raises CancelledError."""
        if self.done:
            return False
        self._end(asyncio.CancelledError())
        self._link.send(scheduler_pb2.SubmitManyRequest(stream_id=self._id, cancel=True))
        return True

    def _expire(self) -> None:
        if not self.done:
            self._end(StreamEnd(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._link.send(scheduler_pb2.SubmitManyRequest(stream_id=self._id, cancel=True))

    def put(self, event: scheduler_pb2.TokenEvent) -> None:
        """A message of the stream (the call's reader): its last has a finish reason."""
        if self.done:
            return
        self._items.append(event)
        if event.finish_reason:
            self._end(FINISHED)
        else:
            self._wake()

    def _end(self, item: StreamEnd | BaseException) -> None:
        self.done = True
        self._items.append(item)
        if self._timer is not None:
            self._timer.cancel()
        self._link.ended(self._id)
        self._wake()

    def fail(self, end: StreamEnd) -> None:
        if not self.done:
            self._end(end)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Link:
    """One SubmitMany call and the streams open on it."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, metadata, on_idle) -> None:
        self.call = stub.SubmitMany(metadata=metadata)
        self.opened_at = asyncio.get_running_loop().time()
        self.streams: dict[int, SchedulerStream] = {}
        self.broken = False
        self.closing = False  # retiring: half-close once no stream is open
        self._on_idle = on_idle
        self._outbox: collections.deque[scheduler_pb2.SubmitManyRequest] = collections.deque()
        self._more = asyncio.Event()
        self._ids = itertools.count(1)
        self._tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]

    def open(self, submit: scheduler_pb2.SubmitRequest, timeout: float | None) -> SchedulerStream:
        stream_id = next(self._ids)
        stream = self.streams[stream_id] = SchedulerStream(self, stream_id, timeout)
        self.send(scheduler_pb2.SubmitManyRequest(stream_id=stream_id, submit=submit))
        return stream

    def send(self, message: scheduler_pb2.SubmitManyRequest) -> None:
        if not self.broken:
            self._outbox.append(message)
            self._more.set()

    def ended(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        if self.closing and not self.streams:
            self._more.set()  # the writer half-closes

    def retire(self) -> None:
        """Half-closes once no stream is open (at once if none is)."""
        self.closing = True
        if not self.streams:
            self._more.set()

    async def _write(self) -> None:
        outbox, call = self._outbox, self.call
        try:
            while True:
                await self._more.wait()
                self._more.clear()
                while outbox:
                    await call.write(outbox.popleft())
                if self.closing and not self.streams:
                    await call.done_writing()
                    return
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call broke: the reader sees why and ends its streams

    async def _read(self) -> None:
        call = self.call
        end = _EARLY  # what each stream still open ends with
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break  # the scheduler ended the call: every stream open ends early
                for item in response.events:
                    stream = self.streams.get(item.stream_id)
                    if stream is None:
                        continue  # cancelled here, or ended by its deadline
                    if item.HasField("error"):
                        stream.fail(_stream_end(item.error))
                    else:
                        stream.put(item.event)
        except grpc.aio.AioRpcError as exc:
            end = StreamEnd(exc.code(), exc.details() or "",
                            tuple(exc.trailing_metadata() or ()))
            if self.streams:
                _log.warning("SubmitMany call broke", code=exc.code().name,
                             details=exc.details(), streams=len(self.streams))
        except asyncio.CancelledError:
            end = StreamEnd(grpc.StatusCode.CANCELLED, "the gateway closed the call")
            raise
        except Exception as exc:  # a message this gateway cannot apply: the call is lost
            _log.exception("SubmitMany call failed here", streams=len(self.streams))
            end = StreamEnd(grpc.StatusCode.UNKNOWN,
                            f"the gateway's SubmitMany call failed: {exc!r}")
            call.cancel()
        finally:
            self.broken = True
            self._tasks[0].cancel()  # the writer: nothing more goes out on this call
            for stream in list(self.streams.values()):
                stream.fail(end)
            self._on_idle(self)

    async def close(self) -> None:
        self.broken = True
        self.call.cancel()
        await cancel_all(self._tasks)


class Mux:
    """A replica's SubmitMany call, opened when a request needs it; with
    ``max_call_age_s`` a call that old takes no new stream (a new one opens)."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, metadata=(),
                 max_call_age_s: float = 0.0) -> None:
        self._stub = stub
        self._metadata = grpc.aio.Metadata(*metadata)
        self._max_age_s = max_call_age_s
        self._link: _Link | None = None
        self._old: set[_Link] = set()  # rotated out, half-closing once their streams end
        self.retiring = False
        self.num_calls = 0  # calls opened, ever

    @property
    def num_open(self) -> int:
        return sum(len(link.streams) for link in self.links)

    @property
    def links(self) -> list[_Link]:
        return [*self._old, *([self._link] if self._link is not None else [])]

    def submit(self, submit: scheduler_pb2.SubmitRequest,
               timeout: float | None) -> SchedulerStream:
        """Opens a stream for ``submit`` (on the current call, or a new one)."""
        link = self._link
        if link is not None and not link.broken and self._max_age_s > 0 and \
                asyncio.get_running_loop().time() - link.opened_at >= self._max_age_s:
            self._old.add(link)  # rotated: it half-closes once its streams end
            link.retire()
            link = None
        if link is None or link.broken:
            link = self._link = _Link(self._stub, self._metadata, self._gone)
            link.closing = self.retiring
            self.num_calls += 1
        return link.open(submit, timeout)

    def _gone(self, link: _Link) -> None:
        self._old.discard(link)
        if self._link is link:
            self._link = None

    def retire(self) -> None:
        """The replica left: its call half-closes once its streams have ended."""
        self.retiring = True
        if self._link is not None:
            self._link.retire()

    async def close(self) -> None:
        links, self._link = self.links, None
        self._old.clear()
        for link in links:
            await link.close()

"""SubmitMany: many requests' streams on one gRPC call (a gateway's, to this replica).

Each stream is what its own Submit call would be (scheduler_svc/streams.py): refused
before it is queued with Submit's status (a ``StreamError``), its events gathered per
``stream_interval`` (the first message and the end at once), a server-ended request's
tokens then its status, its end in the metrics and telemetry. What differs is the cost:
the loop hands each event to the call (``_Sink``, no task per stream) and the call writes
one ``SubmitManyResponse`` with every stream's messages after each step, one gRPC write
where Submit makes one per request (docs/benchmarks.md §4).

One stream's trouble stays its own: a malformed message (no action, a stream id already
open) ends only that stream id, with INVALID_ARGUMENT. The call's end (the gateway gone,
or done sending and every stream ended) aborts whatever is still open, as a cancelled
Submit does, so the blocks are free by the next step.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from protos.continuum.v1 import scheduler_pb2
from scheduler_svc.core import Event, QueueFull, Request
from scheduler_svc.loop import EngineLoop
from scheduler_svc.streams import (
    Refusal,
    fill_event,
    queue_full,
    refusal,
    server_end,
    stream_ended,
    to_request,
)


class _Stream:
    """One open stream: its request, the events not sent yet (``held``), whether its
    first message went, when each token was sent."""

    __slots__ = ("id", "req", "key", "held", "first", "times", "ended")

    def __init__(self, stream_id: int, req: Request) -> None:
        self.id = stream_id
        self.req = req
        self.key = req.request_id
        self.held: list[Event] = []
        self.first = True
        self.times: list[float] = []
        self.ended = False


class _Sink:
    """What the loop puts a stream's events into (in place of Submit's queue)."""

    __slots__ = ("_call", "_stream")

    def __init__(self, call: ManyCall, stream: _Stream) -> None:
        self._call, self._stream = call, stream

    def put_nowait(self, ev: Event) -> None:
        stream = self._stream
        if stream.ended:  # cancelled, or the call ended: nobody reads it
            return
        stream.held.append(ev)
        call = self._call
        call.ready[stream.id] = stream
        if not call.wake.is_set():
            call.wake.set()


class ManyCall:
    """One SubmitMany call's streams and what is due to go out on it."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.open: dict[int, _Stream] = {}
        self.ready: dict[int, _Stream] = {}  # streams with events since the last write
        self.errors: list[scheduler_pb2.StreamEvent] = []  # refusals, malformed messages
        self.wake = asyncio.Event()
        self.reading = True  # the gateway may still open streams

    def receive(self, message: scheduler_pb2.SubmitManyRequest) -> None:
        action = message.WhichOneof("action")
        stream_id = message.stream_id
        if action == "cancel":
            self.cancel(stream_id)
        elif action == "submit" and stream_id not in self.open:
            self.start(stream_id, message.submit)
        else:
            self.cancel(stream_id)  # whatever was open under that id ends with it
            why = ("is already open on this call" if action == "submit"
                   else "has a message with neither submit nor cancel")
            self.fail(stream_id, (grpc.StatusCode.INVALID_ARGUMENT,
                                  f"SubmitMany: stream {stream_id} {why}", ()))

    def start(self, stream_id: int, submit: scheduler_pb2.SubmitRequest) -> None:
        refused = refusal(self.loop, submit)
        if refused is not None:
            self.fail(stream_id, refused)
            return
        req = to_request(submit)
        sink = self.opened(stream_id, req)
        try:
            self.loop.submit(req, sink)
        except QueueFull as exc:
            del self.open[stream_id]
            self.fail(stream_id, queue_full(self.loop, submit, req, exc))
        else:
            self.loop.streams.num_many_streams += 1

    def opened(self, stream_id: int, req: Request) -> _Sink:
        """Opens stream ``stream_id`` for ``req``; returns where its events go."""
        stream = self.open[stream_id] = _Stream(stream_id, req)
        return _Sink(self, stream)

    def cancel(self, stream_id: int) -> None:
        """Aborts the stream, if open: nothing more is sent for it."""
        stream = self.open.pop(stream_id, None)
        if stream is not None:
            self._end(stream, None, finished=False)
            self.loop.abort(stream.key)

    def fail(self, stream_id: int, refused: Refusal) -> None:
        code, message, trailers = refused
        self.errors.append(scheduler_pb2.StreamEvent(
            stream_id=stream_id,
            error=scheduler_pb2.StreamError(code=code.value[0], message=message,
                                            trailers=dict(trailers))))
        self.wake_up()

    def close(self) -> None:
        """The call ended: every stream still open is aborted."""
        for stream in list(self.open.values()):
            self.cancel(stream.id)

    @property
    def done(self) -> bool:
        return not self.reading and not self.open and not self.errors

    def take(self) -> scheduler_pb2.SubmitManyResponse:
        """What goes out now, in one response: the errors, and the messages of every
        stream with events (held back under a stream interval until it has that many, as
        Submit's). Built in place: a message made apart and copied in costs 3x."""
        response = scheduler_pb2.SubmitManyResponse()
        events = response.events
        if self.errors:
            events.extend(self.errors)
            self.errors = []
        interval = self.loop.core.config.stream_interval
        ready, self.ready = self.ready, {}
        now = time.monotonic()
        add = events.add
        for stream in ready.values():
            held = stream.held
            if stream.ended or not held:
                continue
            reason = held[-1][2]
            if reason is None:
                if not stream.first and len(held) < interval:
                    continue  # its next events put it back in ``ready``
                stream.held = []
                if len(held) == 1:
                    if held[0][1] is not None:
                        stream.times.append(now)
                else:
                    stream.times.extend(now for ev in held if ev[1] is not None)
                message = add()
                message.stream_id = stream.id
                fill_event(message.event, held, stream.first)
                stream.first = False
            else:
                stream.held = []
                stream.times.extend(now for ev in held if ev[1] is not None)
                self._last(stream, held, add)
        return response

    def _last(self, stream: _Stream, held: list[Event], add) -> None:
        """A stream's last message: its tokens and finish, or, ended by the server, what
        tokens it has and then the status that says why."""
        req, reason = stream.req, held[-1][2]
        if req.error:
            if len(held) > 1:
                message = add()
                message.stream_id = stream.id
                fill_event(message.event, held[:-1], stream.first)
            code, text, trailers = server_end(req, reason)
            message = add()
            message.stream_id = stream.id
            error = message.error
            error.code, error.message = code.value[0], text
            error.trailers.update(trailers)
        else:
            message = add()
            message.stream_id = stream.id
            fill_event(message.event, held, stream.first)
        stream.first = False
        del self.open[stream.id]
        self._end(stream, reason, finished=True)

    def _end(self, stream: _Stream, reason, finished: bool) -> None:
        stream.ended = True
        stream_ended(self.loop, stream.req, stream.times, reason, finished)

    def wake_up(self) -> None:
        if not self.wake.is_set():
            self.wake.set()


async def _read(call: ManyCall, request_iterator) -> None:
    try:
        async for message in request_iterator:
            call.receive(message)
    finally:
        call.reading = False
        call.wake_up()


async def serve(loop: EngineLoop, request_iterator, context):
    """The responses of one SubmitMany call (see the module docstring)."""
    loop.streams.num_many_calls += 1
    try:
        async for response in respond(ManyCall(loop), request_iterator):
            yield response
    finally:
        loop.streams.num_many_calls -= 1


async def respond(call: ManyCall, request_iterator):
    """``call``'s responses while ``request_iterator`` feeds it, until the gateway is
    done sending and every stream has ended; then, or if the call breaks, whatever is
    still open is aborted."""
    reader = asyncio.create_task(_read(call, request_iterator))
    try:
        while not call.done:
            await call.wake.wait()
            call.wake.clear()
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                return  # the call broke: its streams are aborted below
            response = call.take()
            if response.events:
                yield response
    finally:
        reader.cancel()
        call.close()

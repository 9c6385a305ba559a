"""The requests' streams from this replica to a gateway: many on one SubmitMany call.

Each ``SubmitManyRequest`` opens (``submit``) or cancels (``cancel``) a stream by the
gateway's stream id. Refusals before queueing are ``StreamError``s; events gather in a
``_Sink`` (no task per stream), and after each step one ``SubmitManyResponse`` carries
every stream's messages: one gRPC write for all (docs/benchmarks.md §4).

One stream's trouble stays its own: a malformed message ends only that stream id, with
INVALID_ARGUMENT. The call's end aborts whatever is still open, so the blocks are free
by the next step. A request id is scoped to its tenant (``request_key``), so one tenant
can neither abort another's request nor learn that an id is in use.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from protos.continuum.v1 import sampling_pb2, scheduler_pb2
from protos.echo import clip
from protos.pushback import RETRY_AFTER_KEY
from scheduler_svc.core import Event, FinishReason, QueueFull, Request
from scheduler_svc.core.admission import CONTEXT_EXCEEDED
from scheduler_svc.loop import EngineLoop
from scheduler_svc.telemetry import Stream
from scheduler_svc.validation import validate_submit

# Trailer on an INTERNAL that ended a request the executor kept failing on (a
# poison request): the request itself is the cause, so a gateway must not
# continue it on another replica, where it would fail (or kill) again.
REQUEST_FAILED_KEY = "request-failed"
# Trailer naming OpenAI's machine-readable error code where one applies.
ERROR_CODE_KEY = "error-code"
DEFAULT_TENANT = "default"
# Joins tenant and request id in the internal key; validation keeps it (like
# every non-printable character) out of both, so keys cannot collide.
KEY_SEPARATOR = "\x1f"


def request_key(tenant: str, request_id: str) -> str:
    """The scheduler's id for ``request_id`` of ``tenant`` ("" is the default tenant)."""
    return f"{tenant or DEFAULT_TENANT}{KEY_SEPARATOR}{request_id}"


def server_end(req, reason: FinishReason) -> Refusal:
    """(code, message, trailer) for a request the server ended: a poison request
    (INTERNAL, not to be retried elsewhere), one shed from an overloaded queue
    (RESOURCE_EXHAUSTED with a retry hint), one drained (UNAVAILABLE: go elsewhere)."""
    if reason == FinishReason.ERROR and req.invalid_input:
        return grpc.StatusCode.INVALID_ARGUMENT, req.error, ((REQUEST_FAILED_KEY, "input"),)
    if reason == FinishReason.ERROR:
        return grpc.StatusCode.INTERNAL, req.error, ((REQUEST_FAILED_KEY, "poison"),)
    if req.retry_after_s > 0:
        return (grpc.StatusCode.RESOURCE_EXHAUSTED, req.error,
                ((RETRY_AFTER_KEY, str(int(req.retry_after_s * 1000))),))
    return grpc.StatusCode.UNAVAILABLE, req.error, ()


def _status(req, reason, finished: bool) -> str:
    """A stream's end as the telemetry store names it."""
    if not finished or reason == FinishReason.ABORT:
        return "rejected" if req.retry_after_s > 0 else "aborted"
    return "failed" if reason == FinishReason.ERROR else "finished"


Refusal = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]


def refusal(loop: EngineLoop, request: scheduler_pb2.SubmitRequest) -> Refusal | None:
    """Why ``request`` is refused before it is queued (code, message, trailers), or None."""
    if loop.draining:
        return (grpc.StatusCode.UNAVAILABLE,
                "this scheduler replica is shutting down; retry on another", ())
    if loop.is_known(request_key(request.tenant, request.request_id)):
        return (grpc.StatusCode.ALREADY_EXISTS,
                f"request id {clip(request.request_id)} is already in flight", ())
    problem = validate_submit(request, loop.core)
    if problem is None:
        return None
    trailers = (((ERROR_CODE_KEY, "context_length_exceeded"),)
                if problem.startswith(CONTEXT_EXCEEDED) else ())
    return grpc.StatusCode.INVALID_ARGUMENT, problem, trailers


def queue_full(loop: EngineLoop, request: scheduler_pb2.SubmitRequest, req: Request,
               exc: QueueFull) -> Refusal:
    """The status of a request the queues refused (recorded as rejected)."""
    if loop.recorder is not None:
        loop.recorder.rejected(request.request_id, req.tenant, req.priority_tier,
                               req.num_prompt_tokens, str(exc))
    return (grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{exc}; retry after {exc.retry_after_s:.1f} s",
            ((RETRY_AFTER_KEY, str(int(exc.retry_after_s * 1000))),))


def stream_ended(loop: EngineLoop, req: Request, times: list[float],
                 reason: FinishReason | None, finished: bool) -> None:
    """A stream's end into the replica's metrics and telemetry."""
    loop.histograms.request_ended(req, times, reason)
    if loop.recorder is not None:
        Stream.ended(loop.recorder, req, times, reason, _status(req, reason, finished))


def to_request(r: scheduler_pb2.SubmitRequest) -> Request:
    sampling = sampling_pb2.SamplingParams()
    sampling.CopyFrom(r.sampling)
    return Request(
        request_id=request_key(r.tenant, r.request_id),
        seq_id=0,
        token_ids=list(r.prompt_token_ids),
        num_prompt_tokens=len(r.prompt_token_ids),
        max_tokens=r.max_tokens,
        sampling=sampling,
        stop_token_ids=frozenset(r.sampling.stop_token_ids),
        ignore_eos=r.sampling.ignore_eos,
        min_tokens=r.sampling.min_tokens,
        tenant=r.tenant or DEFAULT_TENANT,
        priority_tier=r.priority_tier,  # validated: < tiers.NUM_TIERS
        arrival_time=time.monotonic(),
        num_resumed_output_tokens=r.num_resumed_output_tokens,
    )


def fill_event(out: scheduler_pb2.TokenEvent, batch: list[Event], first: bool) -> None:
    """One message for ``batch`` (one stream's events, in order; only the last may end
    it), into ``out``, an empty message in place (building it where it goes saves two
    copies of every message)."""
    req, reason = batch[0][0], batch[-1][2]
    if len(batch) == 1:
        token = batch[0][1]
        if token is not None:
            out.token_ids.append(token)
    else:
        out.token_ids.extend([token for _, token, _, _ in batch if token is not None])
    if reason:
        out.finish_reason = int(reason)
    out.num_prompt_tokens = req.num_prompt_tokens
    out.num_generated_tokens = req.num_output_tokens
    for _, token, _, logprob in batch:
        if token is not None and logprob is not None:  # the loop attached its logprobs
            out.logprobs.append(logprob)
    if first and req.first_scheduled_time is not None:
        out.queue_time_s = req.first_scheduled_time - req.arrival_time


# A response's size, about, before the next stream's messages go into another one, and a
# message's events at most: far under gRPC's 4 MiB default a gateway receives, even for a
# stream far behind with top logprobs (~160 bytes a token).
RESPONSE_BYTES = 1 << 20
MESSAGE_EVENTS = 256


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
    """What the loop puts a stream's events into."""

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

    def take(self) -> list[scheduler_pb2.SubmitManyResponse]:
        """What goes out now: the errors, and the messages of every stream with events
        (held back under a stream interval), in responses of about RESPONSE_BYTES, at most
        MESSAGE_EVENTS of a stream's events to a message (one message over gRPC's limit
        would break the call and every stream on it). Built in place: copying costs 3x."""
        response = scheduler_pb2.SubmitManyResponse()
        responses = [response]
        if self.errors:
            response.events.extend(self.errors)
            self.errors = []
        add = response.events.add
        size = 0
        interval = self.loop.core.config.stream_interval
        ready, self.ready = self.ready, {}
        now = time.monotonic()
        for stream in ready.values():
            held = stream.held
            if stream.ended or not held:
                continue
            reason = held[-1][2]
            if reason is None and not stream.first and len(held) < interval:
                continue  # its next events put it back in ``ready``
            if size > RESPONSE_BYTES:
                response = scheduler_pb2.SubmitManyResponse()
                responses.append(response)
                add, size = response.events.add, 0
            stream.held = []
            if len(held) == 1:
                if held[0][1] is not None:
                    stream.times.append(now)
            else:
                stream.times.extend(now for ev in held if ev[1] is not None)
            if reason is None:
                if len(held) > MESSAGE_EVENTS or held[0][3] is not None:
                    size += _put(stream, held, add)  # long, or with logprobs: measured
                    continue
                message = add()  # the common case inline: a token or a few, no logprobs
                message.stream_id = stream.id
                fill_event(message.event, held, stream.first)
                stream.first = False
                size += 24 + 5 * len(held)
            else:
                size += self._last(stream, held, add)
        return responses

    def _last(self, stream: _Stream, held: list[Event], add) -> int:
        """A stream's last messages: its tokens and finish, or, ended by the server, what
        tokens it has and then the status that says why. Returns their size, about."""
        req, reason = stream.req, held[-1][2]
        if req.error:
            size = _put(stream, held[:-1], add) if len(held) > 1 else 0
            code, text, trailers = server_end(req, reason)
            message = add()
            message.stream_id = stream.id
            error = message.error
            error.code, error.message = code.value[0], text
            error.trailers.update(trailers)
            size += message.ByteSize()
        else:
            size = _put(stream, held, add)
        del self.open[stream.id]
        self._end(stream, reason, finished=True)
        return size

    def _end(self, stream: _Stream, reason, finished: bool) -> None:
        stream.ended = True
        stream_ended(self.loop, stream.req, stream.times, reason, finished)

    def wake_up(self) -> None:
        if not self.wake.is_set():
            self.wake.set()


def _put(stream: _Stream, events: list[Event], add) -> int:
    """``events`` as the stream's next messages (MESSAGE_EVENTS at most each), added to a
    response with ``add``; returns their size, about (exact where logprobs make it big)."""
    size = 0
    for lo in range(0, len(events), MESSAGE_EVENTS):
        part = events if len(events) <= MESSAGE_EVENTS else events[lo:lo + MESSAGE_EVENTS]
        message = add()
        message.stream_id = stream.id
        fill_event(message.event, part, stream.first)
        stream.first = False
        size += message.ByteSize() if part[-1][3] is not None or part[0][3] is not None \
            else 24 + 5 * len(part)
    return size

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
            for response in call.take():
                if response.events:
                    yield response
    finally:
        reader.cancel()
        call.close()

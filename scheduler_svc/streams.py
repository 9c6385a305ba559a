"""One request's stream as the scheduler serves it, whichever call carries it (a
Submit call, or one stream of a SubmitMany call, scheduler_svc/submit_many.py): why a
request is refused before it is queued, the Request it becomes, the messages its
events become (gathered per ``stream_interval``), how a server-ended request's status
reads, and its end in the metrics and telemetry.

A request id is scoped to its tenant: the loop and the core know a request by
``request_key(tenant, request_id)``, so one tenant can neither abort another's
request nor learn (from ALREADY_EXISTS) that an id is in use.
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


async def abort_call(context, refused: Refusal) -> None:
    """Ends a Submit call with ``refused``'s status and trailers."""
    code, message, trailers = refused
    if trailers:
        context.set_trailing_metadata(trailers)
    await context.abort(code, message)


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


def take_ready(queue: asyncio.Queue[Event], ev: Event) -> list[Event]:
    """``ev`` and the events queued behind it, up to the stream's end: a stream whose
    writes fell behind the steps (a loop busy streaming to many) sends what it owes in
    one message instead of one per token."""
    batch = [ev]
    while ev[2] is None and not queue.empty():
        ev = queue.get_nowait()
        batch.append(ev)
    return batch


async def next_batch(queue: asyncio.Queue[Event], interval: int, first: bool) -> list[Event]:
    """A stream's next message: what is ready (``take_ready``), then, unless it is the
    stream's first (time to first token is never held back), more until it holds
    ``interval`` events or the stream's end (SchedulerConfig.stream_interval)."""
    batch = take_ready(queue, await queue.get())
    if not first:
        while batch[-1][2] is None and len(batch) < interval:
            batch += take_ready(queue, await queue.get())
    return batch


def to_event(batch: list[Event], first: bool) -> scheduler_pb2.TokenEvent:
    """One message for ``batch`` (one stream's events, in order; only the last may end it)."""
    out = scheduler_pb2.TokenEvent()
    fill_event(out, batch, first)
    return out


def fill_event(out: scheduler_pb2.TokenEvent, batch: list[Event], first: bool) -> None:
    """``to_event`` into ``out``, an empty message in place (a SubmitMany response's:
    building it where it goes saves two copies of every message)."""
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



"""gRPC face of the scheduler: the internal ``continuum.v1.Scheduler`` service.

Handlers validate, hand requests to the loop and stream the loop's events.
A cancelled Submit (client gone, deadline passed) aborts the request, whose
blocks are then free before the next plan is built.

A request id is scoped to its tenant: the loop and the core know a request by
``request_key(tenant, request_id)``, so one tenant can neither abort another's
request nor learn (from ALREADY_EXISTS) that an id is in use.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from protos import tiers
from protos.continuum.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
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


def _server_end(req, reason: FinishReason) -> tuple:
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


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context):  # noqa: N802
        await self._check(request, context)
        recorder = self.loop.recorder
        req = _to_request(request)
        try:
            queue = self.loop.submit(req)
        except QueueFull as exc:
            if recorder is not None:
                recorder.rejected(request.request_id, req.tenant, req.priority_tier,
                                  req.num_prompt_tokens, str(exc))
            retry_ms = int(exc.retry_after_s * 1000)
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_ms)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{exc}; retry after {exc.retry_after_s:.1f} s")
        times: list[float] = []  # when each token was sent: metrics and telemetry
        finished, reason = False, None
        try:
            first = True
            while not finished:
                batch = await next_batch(queue, self.loop.core.config.stream_interval, first)
                reason = batch[-1][2]
                finished = reason is not None
                now = time.monotonic()
                times.extend(now for ev in batch if ev[1] is not None)
                if finished and req.error:  # ended by the server: a status says why
                    if len(batch) > 1:  # the tokens before the end reach the client
                        yield _to_event(batch[:-1], first)
                    await context.abort(*_server_end(req, reason))
                yield _to_event(batch, first)
                first = False
        finally:
            if not finished:
                self.loop.abort(request_key(request.tenant, request.request_id))
            self.loop.histograms.request_ended(req, times, reason)
            if recorder is not None:
                Stream.ended(recorder, req, times, reason, _status(req, reason, finished))

    async def Abort(self, request: scheduler_pb2.AbortRequest, context):  # noqa: N802
        key = request_key(request.tenant, request.request_id)
        return scheduler_pb2.AbortResponse(aborted=self.loop.abort(key))

    async def Stats(self, request, context):  # noqa: N802
        return stats_of(self.loop)

    async def _check(self, request: scheduler_pb2.SubmitRequest, context) -> None:
        if self.loop.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "this scheduler replica is shutting down; retry on another")
        if self.loop.is_known(request_key(request.tenant, request.request_id)):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request id {clip(request.request_id)} is already in flight")
        problem = validate_submit(request, self.loop.core)
        if problem is not None:
            if problem.startswith(CONTEXT_EXCEEDED):
                context.set_trailing_metadata(((ERROR_CODE_KEY, "context_length_exceeded"),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)


def _to_request(r: scheduler_pb2.SubmitRequest) -> Request:
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


def _to_event(batch: list[Event], first: bool) -> scheduler_pb2.TokenEvent:
    """One message for ``batch`` (one stream's events, in order; only the last may end it)."""
    req, reason = batch[0][0], batch[-1][2]
    out = scheduler_pb2.TokenEvent(
        token_ids=[token for _, token, _, _ in batch if token is not None],
        finish_reason=int(reason or 0),
        num_prompt_tokens=req.num_prompt_tokens,
        num_generated_tokens=req.num_output_tokens,
    )
    for _, token, _, logprob in batch:
        if token is not None and logprob is not None:  # the loop attached its logprobs
            out.logprobs.append(logprob)
    if first and req.first_scheduled_time is not None:
        out.queue_time_s = req.first_scheduled_time - req.arrival_time
    return out


def _by_tier(loop: EngineLoop) -> tuple[list[int], list[int]]:
    running, waiting = [0] * tiers.NUM_TIERS, [0] * tiers.NUM_TIERS
    for req in loop.core.running:
        running[req.priority_tier] += 1
    for req in loop.core.requests.values():
        waiting[req.priority_tier] += 1
    return running, [w - r for w, r in zip(waiting, running, strict=True)]


def stats_of(loop: EngineLoop) -> scheduler_pb2.StatsResponse:
    s = loop.core.stats()
    running_by_tier, waiting_by_tier = _by_tier(loop)
    ex, standby = loop.executor, loop.link.standby_hello
    return scheduler_pb2.StatsResponse(
        model_id=ex.model_id if ex else "",
        block_size=ex.model.block_size if ex else 0,
        executor_ready=ex is not None,
        executor_incarnation=ex.incarnation if ex else "",
        num_steps=loop.steps.num_steps,
        max_model_len=ex.model.max_model_len if ex else 0,
        vocab_size=ex.model.vocab_size if ex else 0,
        num_finished=loop.core.num_finished,
        num_preemptions=loop.core.num_preemptions,
        num_executor_losses=loop.num_executor_losses,
        draining=loop.draining,
        executor_num_sequences=loop.link.executor_num_sequences,
        last_lost_executor_pid=loop.last_lost_executor_pid,
        executor_pid=ex.pid if ex else 0,
        standby_executor_pid=standby.pid if standby else 0,
        standby_executor_incarnation=standby.incarnation if standby else "",
        num_standby_takeovers=loop.num_standby_takeovers,
        num_decode_steps=loop.steps.num_decode_steps,
        num_stalled_decode_steps=loop.steps.num_stalled_decode_steps,
        num_stalled_prefill_tokens=loop.steps.num_stalled_prefill_tokens,
        num_columnar_updates=loop.core.num_columnar_updates,
        num_update_fallbacks=loop.core.num_update_fallbacks,
        num_dropped_frames=loop.num_dropped_frames,
        num_failed_steps=loop.faults.num_failed_steps,
        num_resyncs=loop.faults.num_resyncs,
        num_recomputed_tokens=loop.core.num_recomputed_tokens,
        num_row_failures=loop.faults.num_row_failures,
        num_executor_dropped_sequences=loop.faults.num_executor_dropped_sequences,
        num_running_by_tier=running_by_tier,
        num_waiting_by_tier=waiting_by_tier,
        **s,
    )

"""gRPC face of the scheduler: the internal ``continuum.v1.Scheduler`` service.

Handlers validate, hand requests to the loop and stream the loop's events: one
request per Submit call, or many on one SubmitMany call (scheduler_svc/submit_many.py),
each stream as scheduler_svc/streams.py serves it. A cancelled Submit (client gone,
deadline passed) aborts the request, whose blocks are then free before the next plan
is built.
"""

from __future__ import annotations

import time

from protos import tiers
from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import submit_many
from scheduler_svc.core import QueueFull
from scheduler_svc.loop import EngineLoop
from scheduler_svc.streams import (
    abort_call,
    next_batch,
    queue_full,
    refusal,
    request_key,
    server_end,
    stream_ended,
    to_event,
    to_request,
)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context):  # noqa: N802
        refused = refusal(self.loop, request)
        if refused is not None:
            await abort_call(context, refused)
        req = to_request(request)
        try:
            queue = self.loop.submit(req)
        except QueueFull as exc:
            await abort_call(context, queue_full(self.loop, request, req, exc))
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
                        yield to_event(batch[:-1], first)
                    await abort_call(context, server_end(req, reason))
                yield to_event(batch, first)
                first = False
        finally:
            if not finished:
                self.loop.abort(request_key(request.tenant, request.request_id))
            stream_ended(self.loop, req, times, reason, finished)

    async def SubmitMany(self, request_iterator, context):  # noqa: N802
        async for response in submit_many.serve(self.loop, request_iterator, context):
            yield response

    async def Abort(self, request: scheduler_pb2.AbortRequest, context):  # noqa: N802
        key = request_key(request.tenant, request.request_id)
        return scheduler_pb2.AbortResponse(aborted=self.loop.abort(key))

    async def Stats(self, request, context):  # noqa: N802
        return stats_of(self.loop)


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
        submit_many=True,
        num_running_by_tier=running_by_tier,
        num_waiting_by_tier=waiting_by_tier,
        **s,
    )

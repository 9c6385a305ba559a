"""gRPC face of the scheduler: the internal ``continuum.v1.Scheduler`` service.

A gateway's requests come on its SubmitMany call (scheduler_svc/streams.py serves each
stream); Abort ends one by id, Stats is what gateways route and watch by.
"""

from __future__ import annotations

from protos import tiers
from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import streams
from scheduler_svc.loop import EngineLoop
from scheduler_svc.streams import request_key


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    async def SubmitMany(self, request_iterator, context):  # noqa: N802
        async for response in streams.serve(self.loop, request_iterator, context):
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

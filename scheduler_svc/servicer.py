"""gRPC face of the scheduler: the internal ``continuum.v1.Scheduler`` service.

Handlers validate, hand requests to the loop and stream the loop's events.
A cancelled Submit (client gone, deadline passed) aborts the request, whose
blocks are then free before the next plan is built.
"""

from __future__ import annotations

import time

import grpc

from protos.continuum.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.core import Request
from scheduler_svc.loop import EngineLoop

RETRY_AFTER_MS_KEY = "retry-after-ms"


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context):  # noqa: N802
        await self._admit_or_abort(request, context)
        queue = self.loop.submit(_to_request(request))
        finished = False
        try:
            first = True
            while not finished:
                ev = await queue.get()
                finished = ev.finish_reason is not None
                yield _to_event(ev, first)
                first = False
        finally:
            if not finished:
                self.loop.abort(request.request_id)

    async def Abort(self, request: scheduler_pb2.AbortRequest, context):  # noqa: N802
        return scheduler_pb2.AbortResponse(aborted=self.loop.abort(request.request_id))

    async def Stats(self, request, context):  # noqa: N802
        return stats_of(self.loop)

    async def _admit_or_abort(self, request: scheduler_pb2.SubmitRequest, context) -> None:
        if self.loop.is_known(request.request_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request id {request.request_id!r} is already in flight")
        problem = validate_submit(request, self.loop)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        core = self.loop.core
        if len(core.waiting) >= core.config.max_num_waiting:
            context.set_trailing_metadata(((RETRY_AFTER_MS_KEY, "1000"),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the queue is full ({core.config.max_num_waiting} requests waiting); "
                "retry after 1 s",
            )


def validate_submit(request: scheduler_pb2.SubmitRequest, loop: EngineLoop) -> str | None:
    """A message for the caller when the request can never be served, else None."""
    if not request.request_id:
        return "request_id must not be empty"
    if not request.prompt_token_ids:
        return "prompt_token_ids must not be empty"
    if request.max_tokens <= 0:
        return "max_tokens must be > 0"
    if loop.executor is None:
        return None  # limits are unknown until an executor registers; it waits
    model = loop.executor.model
    total = len(request.prompt_token_ids) + request.max_tokens
    if total > model.max_model_len:
        return (
            f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
            f"({request.max_tokens}) = {total} exceeds the model's context of "
            f"{model.max_model_len} tokens"
        )
    bad = next((t for t in request.prompt_token_ids if t >= model.vocab_size), None)
    if bad is not None:
        return f"token id {bad} is outside the vocabulary (size {model.vocab_size})"
    bm = loop.core.block_manager
    usable = bm.num_blocks - loop.core.config.watermark_blocks
    if bm.blocks_needed(len(request.prompt_token_ids)) > usable:
        return (
            f"the prompt needs {bm.blocks_needed(len(request.prompt_token_ids))} KV blocks but "
            f"the pool has {usable} usable; shorten the prompt or raise --kv-cache-bytes"
        )
    return None


def _to_request(r: scheduler_pb2.SubmitRequest) -> Request:
    sampling = sampling_pb2.SamplingParams()
    sampling.CopyFrom(r.sampling)
    return Request(
        request_id=r.request_id,
        seq_id=0,
        token_ids=list(r.prompt_token_ids),
        num_prompt_tokens=len(r.prompt_token_ids),
        max_tokens=r.max_tokens,
        sampling=sampling,
        stop_token_ids=frozenset(r.sampling.stop_token_ids),
        ignore_eos=r.sampling.ignore_eos,
        min_tokens=r.sampling.min_tokens,
        tenant=r.tenant or "default",
        priority_tier=min(r.priority_tier, 2),
        arrival_time=time.monotonic(),
        num_resumed_output_tokens=r.num_resumed_output_tokens,
    )


def _to_event(ev, first: bool) -> scheduler_pb2.TokenEvent:
    req = ev.request
    out = scheduler_pb2.TokenEvent(
        token_ids=ev.new_token_ids,
        finish_reason=int(ev.finish_reason or 0),
        num_prompt_tokens=req.num_prompt_tokens,
        num_generated_tokens=req.num_output_tokens,
    )
    if first and req.first_scheduled_time is not None:
        out.queue_time_s = req.first_scheduled_time - req.arrival_time
    return out


def stats_of(loop: EngineLoop) -> scheduler_pb2.StatsResponse:
    s = loop.core.stats()
    ex = loop.executor
    return scheduler_pb2.StatsResponse(
        model_id=ex.model_id if ex else "",
        block_size=ex.model.block_size if ex else 0,
        executor_ready=ex is not None,
        executor_incarnation=ex.incarnation if ex else "",
        num_steps=loop.num_steps,
        max_model_len=ex.model.max_model_len if ex else 0,
        vocab_size=ex.model.vocab_size if ex else 0,
        num_finished=loop.core.num_finished,
        num_preemptions=loop.core.num_preemptions,
        **s,
    )

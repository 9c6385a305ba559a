"""Runs a validated request on the scheduler replicas, whatever the client protocol.

`Relay.generate` yields `GenerateResponse`s and raises `RelayError` with the
status the client should get; the gRPC servicer and the HTTP API both consume
it, so failover, `n`, timing and metrics behave the same on both.

Consumers must close the generator when they stop early (`contextlib.aclosing`):
closing it cancels the upstream Submit calls, so the scheduler frees the
request's KV blocks by its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from gateway.metrics import GatewayMetrics
from gateway.output_stream import OutputStream
from gateway.replicas import ReplicaSet
from gateway.tokenizer import Tokenizer
from gateway.upstream import ClientStatus, client_status
from gateway.validation import ValidatedRequest
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2

_log = structlog.get_logger("gateway")

# Upstream failures that mean "this replica cannot go on", not "this request
# is wrong": the request continues on another replica.
_REPLICA_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
})
_FINISH_NAMES = {
    sampling_pb2.FINISH_REASON_STOP: "stop",
    sampling_pb2.FINISH_REASON_LENGTH: "length",
    sampling_pb2.FINISH_REASON_ABORT: "abort",
    sampling_pb2.FINISH_REASON_ERROR: "error",
}

TimeRemaining = Callable[[], float | None]


class RelayError(Exception):
    """The request failed; `status` is what the client gets."""

    def __init__(self, status: ClientStatus):
        super().__init__(status.message)
        self.status = status


class _EndedEarly(Exception):
    """The upstream stream ended without a finish reason (the replica went away)."""


def finish_name(reason: int) -> str:
    return _FINISH_NAMES.get(reason, "error")


def continuation(request: ValidatedRequest, output: OutputStream) -> scheduler_pb2.SubmitRequest:
    """What to submit so generation resumes right after the tokens already
    streamed: prompt + those tokens, the remaining max_tokens. Seeded sampling
    is keyed by position, so the continuation draws what the lost replica would."""
    submit = request.to_submit()
    done = output.token_ids
    if done:
        submit.prompt_token_ids.extend(done)
        submit.max_tokens -= len(done)
        submit.num_resumed_output_tokens = len(done)
    return submit


def _choice(request: ValidatedRequest, index: int) -> ValidatedRequest:
    """Completion `index` of an n > 1 request: its own id and, when seeded, seed + index."""
    sampling = sampling_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    if sampling.HasField("seed"):
        sampling.seed = (sampling.seed + index) % 2**64
    return dataclasses.replace(
        request, request_id=f"{request.request_id}-{index}", sampling=sampling, n=1
    )


class Relay:
    """Serves validated requests for one model by relaying to scheduler replicas."""

    def __init__(self, tokenizer: Tokenizer, replicas: ReplicaSet, metrics: GatewayMetrics):
        self._tokenizer = tokenizer
        self._replicas = replicas
        self.metrics = metrics

    async def generate(
        self, request: ValidatedRequest, time_remaining: TimeRemaining = lambda: None,
        api: str = "grpc", stream: bool = True,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Yields every response of every completion; the last one of each has finish_reason."""
        accepted = time.monotonic()
        log = _log.bind(request_id=request.request_id)
        log.info("request accepted", api=api, stream=stream, tenant=request.tenant,
                 priority_tier=request.priority_tier, n=request.n,
                 prompt_tokens=len(request.prompt_token_ids), max_tokens=request.max_tokens)
        labels = self.metrics.labels(request.priority_tier)
        self.metrics.prompt_tokens.labels(*labels).inc(len(request.prompt_token_ids))
        try:
            if request.n == 1:
                async for response in self._one(request, 0, accepted, time_remaining, log):
                    yield response
            else:
                async for response in self._many(request, accepted, time_remaining, log):
                    yield response
        except RelayError as exc:
            self.metrics.error(exc.status.code.name)
            raise

    async def _many(self, request, accepted, time_remaining, log):
        """Runs the n completions side by side and interleaves their responses."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int) -> None:
            try:
                async for response in self._one(
                    _choice(request, index), index, accepted, time_remaining, log
                ):
                    await queue.put(response)
            except Exception as exc:  # handed to the consumer, which re-raises it
                await queue.put(exc)
            await queue.put(done)

        tasks = [asyncio.create_task(pump(i)) for i in range(request.n)]
        try:
            running = request.n
            while running:
                item = await queue.get()
                if item is done:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:  # the client left or one completion failed: stop the others too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(
        self,
        request: ValidatedRequest,
        index: int,
        accepted: float,
        time_remaining: TimeRemaining,
        log,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """One completion, continued on another replica if its replica fails."""
        output = OutputStream(request, self._tokenizer)
        metrics, labels = self.metrics, self.metrics.labels(request.priority_tier)
        # Resolved once: a labelled child costs a dict lookup under a lock per call.
        itl = metrics.itl.labels(*labels)
        tried: set[str] = set()
        failure = ClientStatus(grpc.StatusCode.UNAVAILABLE,
                               f"no scheduler replica at {self._replicas.addresses}")
        first_token_at: float | None = None
        last_token_at = accepted
        queue_time_s = 0.0
        while not output.finished:
            replica = self._replicas.pick(tried)
            if replica is None:  # every replica failed: say how the last one did
                raise RelayError(failure)
            tried.add(replica.address)
            submit = continuation(request, output)
            if submit.max_tokens <= 0:  # the replica died between the last token and its end
                event = scheduler_pb2.TokenEvent(finish_reason=sampling_pb2.FINISH_REASON_LENGTH)
                response = output.on_event(event)
                response.index = index
                yield response
                break
            call = replica.stub.Submit(submit, timeout=time_remaining())
            try:
                async for event in call:
                    if event.queue_time_s and not queue_time_s:  # sent with the first event
                        queue_time_s = event.queue_time_s
                    response = output.on_event(event)
                    response.index = index
                    now = time.monotonic()
                    if response.token_ids:
                        if first_token_at is None:
                            first_token_at = now
                            metrics.ttft.labels(*labels).observe(now - accepted)
                        else:
                            itl.observe(now - last_token_at)
                        last_token_at = now
                    if output.finished:
                        timing = response.timing
                        timing.queue_time_s = queue_time_s
                        timing.time_to_first_token_s = (first_token_at or now) - accepted
                        timing.e2e_latency_s = now - accepted
                    yield response
                    if output.finished:
                        break
                else:
                    raise _EndedEarly
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _REPLICA_FAILURES:
                    log.warning("upstream failed", code=exc.code().name, details=exc.details())
                    raise RelayError(client_status(exc, replica.address)) from exc
                failure = client_status(exc, replica.address)
                log.warning("replica failed; continuing elsewhere", replica=replica.address,
                            code=exc.code().name, streamed=len(output.token_ids))
            except _EndedEarly:
                failure = ClientStatus(grpc.StatusCode.UNAVAILABLE, f"the scheduler at "
                                       f"{replica.address} ended the stream without finishing")
                log.warning("replica ended the stream early; continuing elsewhere",
                            replica=replica.address, streamed=len(output.token_ids))
            finally:
                # Idempotent after a normal finish; essential on every early exit
                # (client gone, deadline passed, stop string matched).
                call.cancel()
        finished = time.monotonic()
        metrics.e2e.labels(*labels).observe(finished - accepted)
        metrics.queue.labels(*labels).observe(queue_time_s)
        metrics.generation_tokens.labels(*labels).inc(output.num_generated_tokens)
        metrics.success.labels(*labels, finish_name(output.finish_reason)).inc()
        log.info(
            "completion finished",
            index=index,
            finish_reason=finish_name(output.finish_reason),
            stop_string=output.stopped_by_string,
            completion_tokens=output.num_generated_tokens,
            replicas=len(tried),
            elapsed_s=round(finished - accepted, 4),
        )

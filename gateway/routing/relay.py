"""Runs a validated request on the scheduler replicas, whatever the client protocol.

`Relay.generate` yields `GenerateResponse`s and raises `RelayError` with the client's
status; both front ends consume it, so failover, `n`, timing and metrics are the same on
both. Consumers must close the generator when they stop early (`contextlib.aclosing`):
that cancels upstream, so the scheduler frees the request's KV blocks by its next step."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from gateway.log_sampling import Sampled
from gateway.metrics import GatewayMetrics
from gateway.routing.replicas import ReplicaSet
from gateway.routing.upstream import (
    REPLICA_FAILURES,
    ClientStatus,
    StreamEnd,
    client_status,
    request_failed,
)
from gateway.routing.watchdog import Completion, Stream, Watchdog
from gateway.text.output_stream import OutputStream
from gateway.text.tokenizer import Tokenizer
from gateway.validation import ValidatedRequest
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2
from runtime.aio import cancel_all

_log = structlog.get_logger("gateway")
# A scheduler's overload refusals, one line a second however many (the metrics count each).
_log_overload = Sampled(_log, "warning", "upstream refused: overloaded")

_FINISH_NAMES = {
    sampling_pb2.FINISH_REASON_STOP: "stop",
    sampling_pb2.FINISH_REASON_LENGTH: "length",
    sampling_pb2.FINISH_REASON_ABORT: "abort",
    sampling_pb2.FINISH_REASON_ERROR: "error",
}

TimeRemaining = Callable[[], float | None]
# After drain's grace period, how long the streams still running get to deliver
# their terminal error before connections are cut.
END_S = 2.0


class RelayError(Exception):
    """The request failed; `status` is what the client gets."""

    def __init__(self, status: ClientStatus):
        super().__init__(status.message)
        self.status = status


class _Ended(Exception):
    """The upstream stream ended without a finish reason: ``args[0]`` is its StreamEnd."""


class _Stalled(Exception):
    """The watchdog cut the upstream call: the replica stopped answering."""


DRAINING = ClientStatus(grpc.StatusCode.UNAVAILABLE,
                        "this gateway is shutting down; retry (another replica will serve it)")


async def end_after_grace(relay: Relay, grace_s: float) -> None:
    """Drain: refuses new streams at once, waits up to ``grace_s``, then ends the rest
    with UNAVAILABLE and gives them END_S to say so."""
    relay.refuse_new(DRAINING)
    finished = await relay.wait_idle(grace_s)
    relay.end_all(ClientStatus(
        grpc.StatusCode.UNAVAILABLE,
        f"the gateway is shutting down and its grace period of {grace_s:g} s is over; "
        "retry the request (another gateway will serve it)"))
    if not finished:
        await relay.wait_idle(END_S)


def finish_name(reason: int) -> str:
    return _FINISH_NAMES.get(reason, "error")


def continuation(request: ValidatedRequest, output: OutputStream) -> scheduler_pb2.SubmitRequest:
    """What to submit so generation resumes after the tokens already streamed (seeded
    sampling is keyed by position, so it draws what the lost replica would)."""
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


class _Timing:
    """One completion's clock: TTFT and ITL are observed as its tokens arrive."""

    __slots__ = ("accepted", "first_token_at", "itl", "last_token_at", "queue_time_s", "ttft")

    def __init__(self, accepted: float, ttft, itl):
        self.accepted = self.last_token_at = accepted
        self.first_token_at: float | None = None
        self.queue_time_s = 0.0
        self.ttft, self.itl = ttft, itl  # labelled children, resolved once

    def on_tokens(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
            self.ttft.observe(now - self.accepted)
        else:
            self.itl.observe(now - self.last_token_at)
        self.last_token_at = now


def _replica_failure(exc: Exception, address: str, streamed: int, log) -> ClientStatus:
    """How the replica at `address` failed, when the request may continue on another;
    raises RelayError when the failure is the request's own (a bad request, a poison one)."""
    if isinstance(exc, _Stalled):
        log.warning("replica stalled; continuing elsewhere", replica=address, streamed=streamed)
        return ClientStatus(grpc.StatusCode.UNAVAILABLE,
                            f"the scheduler at {address} stopped responding")
    end: StreamEnd = exc.args[0]
    if end.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # overload: comes in crowds
        _log_overload(code=end.code.name, details=end.details)
        raise RelayError(client_status(end, address)) from None
    if end.code not in REPLICA_FAILURES or request_failed(end):
        log.warning("upstream failed", code=end.code.name, details=end.details)
        raise RelayError(client_status(end, address)) from None
    log.warning("replica failed; continuing elsewhere", replica=address,
                code=end.code.name, details=end.details, streamed=streamed)
    return client_status(end, address)


class Relay:
    """Serves validated requests for one model by relaying to scheduler replicas."""

    def __init__(self, tokenizer: Tokenizer, replicas: ReplicaSet, metrics: GatewayMetrics,
                 watchdog: Watchdog | None = None):
        self._tokenizer = tokenizer
        self._replicas = replicas
        self.metrics = metrics
        self.watchdog = watchdog or Watchdog(metrics.intervention)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no stream is live (False if ``timeout_s`` passed first)."""
        return await self.watchdog.wait_idle(timeout_s)

    def refuse_new(self, status: ClientStatus) -> None:
        """From now on, new streams fail at once with ``status`` (drain's start)."""
        self.watchdog.refusing = status

    def end_all(self, status: ClientStatus) -> None:
        """Ends every live stream, and refuses new ones, with ``status`` (drain's end)."""
        self.watchdog.end_all(status)

    async def close(self) -> None:
        await self.watchdog.close()

    async def generate(
        self, request: ValidatedRequest, time_remaining: TimeRemaining = lambda: None,
        api: str = "grpc", stream: bool = True,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Yields every response of every completion; the last one of each has finish_reason."""
        accepted = time.monotonic()
        log = _log.bind(request_id=request.request_id)
        log.info("request accepted", api=api, stream=stream, tenant=request.tenant,
                 priority_tier=request.tier, n=request.n,
                 prompt_tokens=len(request.prompt_token_ids), max_tokens=request.max_tokens)
        labels = self.metrics.labels(request.tier)
        self.metrics.prompt_tokens.inc(labels, len(request.prompt_token_ids))
        watch = Stream(asyncio.current_task(), request.request_id)
        self.watchdog.add(watch)
        try:
            refusal = self.watchdog.ended or self.watchdog.refusing
            if refusal is not None:
                raise RelayError(refusal)
            if request.n == 1:
                responses = self._one(request, 0, accepted, time_remaining, log, watch)
            else:
                responses = self._many(request, accepted, time_remaining, log, watch)
            async with contextlib.aclosing(responses):
                async for response in responses:
                    # Parked while the consumer writes: a client that stops reading
                    # shows up here, as a stream parked for too long.
                    watch.parked_since = time.monotonic()
                    yield response
                    watch.parked_since = None
        except RelayError as exc:
            self.metrics.error(exc.status.code.name)
            raise
        finally:
            self.watchdog.discard(watch)

    async def _many(self, request, accepted, time_remaining, log, watch):
        """Runs the n completions side by side and interleaves their responses."""
        # Bounded: a slow consumer holds the pumps back.
        queue: asyncio.Queue = asyncio.Queue(maxsize=2 * request.n)
        done = object()

        async def pump(index: int) -> None:
            try:
                async for response in self._one(
                    _choice(request, index), index, accepted, time_remaining, log, watch
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
            await cancel_all(tasks)

    async def _one(
        self,
        request: ValidatedRequest,
        index: int,
        accepted: float,
        time_remaining: TimeRemaining,
        log,
        watch: Stream,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """One completion, continued on another replica if its replica fails or stalls."""
        output = OutputStream(request, self._tokenizer)
        metrics, labels = self.metrics, self.metrics.labels(request.tier)
        timing = _Timing(accepted, metrics.ttft.child(labels), metrics.itl.child(labels))
        leg = Completion()
        watch.completions.append(leg)
        tried: set[str] = set()
        failure = ClientStatus(grpc.StatusCode.UNAVAILABLE,
                               f"no scheduler replica at {self._replicas.addresses}")
        while not output.finished:
            if leg.ended is not None:
                raise RelayError(leg.ended)
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
            call = replica.submit(submit, time_remaining())
            leg.replica, leg.call, leg.stalled = replica, call, False
            leg.heard_at = time.monotonic()
            try:
                async for response in self._attempt(call, leg, output, index, timing):
                    leg.parked = True
                    yield response
                    leg.parked = False
                    if leg.ended is not None and not output.finished:
                        raise RelayError(leg.ended)
            except (_Ended, _Stalled) as exc:
                failure = _replica_failure(exc, replica.address, len(output.token_ids), log)
            finally:
                call.cancel()  # idempotent after a finish; essential on every early exit
                leg.call, leg.parked = None, False
        self._finished(request, index, output, timing, len(tried), log)

    async def _attempt(self, call, leg: Completion, output: OutputStream, index: int,
                       timing: _Timing) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """One upstream stream's responses until the completion finishes; raises _Ended,
        _Stalled or RelayError (drain ended it)."""
        while True:
            try:
                event = await call.read()
            except asyncio.CancelledError:
                # Cut by the watchdog or by drain, not by our own task's cancellation.
                if asyncio.current_task().cancelling():
                    raise
                if leg.ended is not None:
                    raise RelayError(leg.ended) from None
                if leg.stalled:
                    raise _Stalled from None
                raise
            if event.__class__ is StreamEnd:
                raise _Ended(event)
            now = leg.heard_at = time.monotonic()
            if event.queue_time_s and not timing.queue_time_s:  # sent with the first event
                timing.queue_time_s = event.queue_time_s
            response = output.on_event(event)
            response.index = index
            if response.token_ids:
                timing.on_tokens(now)
            if output.finished:
                final = response.timing
                final.queue_time_s = timing.queue_time_s
                final.time_to_first_token_s = (timing.first_token_at or now) - timing.accepted
                final.e2e_latency_s = now - timing.accepted
                yield response
                return
            yield response

    def _finished(self, request: ValidatedRequest, index: int, output: OutputStream,
                  timing: _Timing, num_replicas: int, log) -> None:
        metrics, labels = self.metrics, self.metrics.labels(request.tier)
        finished = time.monotonic()
        metrics.e2e.child(labels).observe(finished - timing.accepted)
        metrics.queue.child(labels).observe(timing.queue_time_s)
        metrics.generation_tokens.inc(labels, output.num_generated_tokens)
        metrics.success.inc((*labels, finish_name(output.finish_reason)))
        log.info(
            "completion finished",
            index=index,
            finish_reason=finish_name(output.finish_reason),
            stop_string=output.stopped_by_string,
            completion_tokens=output.num_generated_tokens,
            replicas=num_replicas,
            elapsed_s=round(finished - timing.accepted, 4),
        )

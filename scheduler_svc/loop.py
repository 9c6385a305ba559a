"""The one loop that owns the scheduler core (docs/style.md habit 7).

RPC handlers only queue work (``submit``/``abort``) and read their request's event queue;
everything runs on one asyncio loop, so there are no locks. Faults: failed or refused
steps and failing rows are handled by scheduler_svc/step_faults.py, lateness by
step_deadline.py, hangs by hang_check.py; a lost executor is replaced at once by a warm
standby when one is registered. A dead task the loop depends on resolves ``fatal``: the
process must report NOT_SERVING and exit non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Protocol

import structlog

from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from runtime import internal_auth
from runtime.aio import cancel_all
from scheduler_svc.core import Event, Request, Scheduler, SchedulerConfig
from scheduler_svc.executors import ExecutorInfo
from scheduler_svc.gc_pacing import GcPacer
from scheduler_svc.hang_check import await_answer
from scheduler_svc.inflight import InFlightPlans
from scheduler_svc.link import ExecutorLink
from scheduler_svc.logprobs import with_logprobs
from scheduler_svc.metrics import Histograms
from scheduler_svc.plan import PlanBuilder
from scheduler_svc.step_deadline import StepDeadlines
from scheduler_svc.step_faults import StepFaults
from scheduler_svc.step_stats import StepStats
from scheduler_svc.telemetry import Recorder

log = structlog.get_logger("scheduler.loop")

# Idle: a heartbeat every HEARTBEAT_S; no answer within --executor-heartbeat-timeout-s
# means the executor is hung.
HEARTBEAT_S = 1.0
_FROM_ENV = object()



# Where each request's events go: a sink per SubmitMany stream (scheduler_svc/streams.py)
# or, for a test driving the loop alone, an asyncio.Queue; ``Streams`` maps request ids
# to them and counts SubmitMany's calls and streams for /metrics.
class EventSink(Protocol):
    """A request's events go here, on the loop; must not block."""

    def put_nowait(self, ev: Event) -> None: ...


class Streams:
    """Request id → its sink, while the request lives."""

    __slots__ = ("_sinks", "num_many_calls", "num_many_streams")

    def __init__(self) -> None:
        self._sinks: dict[str, EventSink] = {}
        self.num_many_calls = 0  # SubmitMany calls open now
        self.num_many_streams = 0  # streams SubmitMany calls queued, ever

    def add(self, request_id: str, sink: EventSink) -> None:
        self._sinks[request_id] = sink

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sinks

    def dispatch(self, events: list[Event]) -> None:
        sinks = self._sinks
        for ev in events:
            req, _, reason, _ = ev
            sink = sinks.get(req.request_id)
            if sink is None:
                continue
            sink.put_nowait(ev)
            if reason is not None:
                del sinks[req.request_id]


class EngineLoop:
    """Drives schedule → plan → executor → update.

    With ``async_scheduling`` two plans are in flight: step N+1 is built and sent while
    step N runs, so the executor never waits for the scheduler's CPU (the core schedules
    ahead, see Scheduler.schedule). Without it, one step at a time.
    """

    def __init__(self, config: SchedulerConfig, ipc_address: str,
                 secret: bytes | None | object = _FROM_ENV, plan_channel: str = "auto",
                 heartbeat_timeout_s: float = 5.0) -> None:
        """``secret``: what an executor's Hello must be signed with; by default the
        deployment's (internal_auth.load_secret: raises SecretError when none is set).
        ``plan_channel``: "auto" (the ring on a host with a core to spare for its reader),
        "shm" (a shared-memory ring where possible) or "zmq" (scheduler_svc/plan_channel.py)."""
        if secret is _FROM_ENV:
            secret = internal_auth.load_secret()
        self.core = Scheduler(config)
        self.link = ExecutorLink(ipc_address, self._on_hello, self._on_result,
                                 self._on_lost, secret=secret, on_fatal=self._die,
                                 plan_channel=plan_channel)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # Resolved (with the reason) when a task the loop depends on died.
        self.fatal: asyncio.Future[str] | None = None
        self.streams = Streams()  # each request's call's stream
        self._dispatch = self.streams.dispatch
        self.faults = StepFaults(self.core, self._dispatch)  # blame, resync, counters
        self.executor: ExecutorInfo | None = None
        # The last executor that registered: its pool is the replica's KV configuration
        # for /metrics while a replacement loads (scheduler_svc/metrics.py).
        self.last_executor: ExecutorInfo | None = None
        self.steps = StepStats()  # answered steps: counts and times
        self._seq_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._pending_hello: pb.Hello | None = None
        self._inflight = InFlightPlans()
        self._plans = PlanBuilder()  # owns each request's prompt in wire form
        self.deadlines = StepDeadlines()
        self._stepping = False
        self.draining = False  # set on SIGTERM: new requests are refused
        self.num_executor_losses = 0
        self.num_standby_takeovers = 0
        self._untried_standby = False  # in service after a takeover, no answer yet
        self.last_lost_executor_pid = 0
        self._tasks: list[asyncio.Task] = []
        self.recorder: Recorder | None = None  # telemetry (scheduler_svc/telemetry.py)
        self.histograms = Histograms()  # the replica's /metrics (scheduler_svc/metrics.py)
        self.gc = GcPacer()  # collections off the step path once the entry point takes over

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.fatal = loop.create_future()
        self.link.start()
        self._tasks = [loop.create_task(self._run(), name="loop.run"),
                       loop.create_task(self._heartbeats(), name="loop.heartbeats")]
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled():  # these loops never return: any end is a death
            self._die(f"{task.get_name()} died: {task.exception()!r}")

    def _die(self, why: str) -> None:
        log.error("a task the scheduler depends on died; the process must restart", why=why)
        if self.fatal is not None and not self.fatal.done():
            self.fatal.set_result(why)

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        await self.link.close()

    @property
    def has_work(self) -> bool:
        return self.core.has_work()

    # -- commands from RPC handlers ----------------------------------------------

    def submit(self, req: Request, sink: EventSink | None = None) -> EventSink:
        """Queues ``req``; raises QueueFull when a queue cap is reached. Its events go
        to ``sink`` (by default a new asyncio.Queue), which is returned."""
        req.seq_id = next(self._seq_ids)
        self.core.add_request(req)
        self._plans.prepare(req)  # now, not in the step that admits it
        queue = asyncio.Queue() if sink is None else sink
        self.streams.add(req.request_id, queue)
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> bool:
        """Idempotent. The blocks are free before the next plan is built."""
        event = self.core.abort(request_id)
        if event is not None:
            self._dispatch([event])
            self._wake.set()
        return event is not None

    def abort_all(self, message: str) -> int:
        """Ends every request still in flight with ABORT and ``message`` (``req.error``;
        the servicer turns it into an UNAVAILABLE status, so a gateway continues the
        request elsewhere): for a drain past its grace period, or a dying process.
        Returns how many were ended."""
        events = []
        for request_id in list(self.core.requests):
            event = self.core.abort(request_id)
            if event is not None:
                event.request.error = message
                events.append(event)
        self._dispatch(events)
        self._wake.set()
        return len(events)

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Hot reload (scheduler_svc/admin.py): RPC handlers run on this event loop,
        never inside a ``schedule()``, so the next plan is the first built with it."""
        self.core.reconfigure(config)
        self._wake.set()  # a lifted limit may admit what waits while the loop idles

    @property
    def num_dropped_frames(self) -> int:
        return self.link.num_dropped_frames

    def is_known(self, request_id: str) -> bool:
        return request_id in self.streams

    # -- executor messages -------------------------------------------------------

    def _on_hello(self, identity: bytes, hello: pb.Hello) -> None:
        log.info("executor registered", incarnation=hello.incarnation, model=hello.model_id,
                 blocks=hello.num_device_blocks, block_size=hello.block_size,
                 prefill_tokens_per_s=round(hello.prefill_tokens_per_s))
        self._pending_hello = hello
        self._untried_standby = False
        if self.recorder is not None:
            self.recorder.model_version = hello.model_id
        # Acknowledge, so the executor stops re-sending its Hello.
        self.link.send_heartbeat(hello.incarnation, 0)
        self._inflight.fail_all()  # the old incarnation's steps will never answer
        self._wake.set()

    def _on_result(self, result: pb.StepResult) -> None:
        if self.executor is None or result.incarnation != self.executor.incarnation:
            return  # a stale incarnation's answer
        columns = wire.result_columns(result)
        problem = wire.result_problem(result, self.executor.model.vocab_size, columns,
                                      self.core.expected_samplers(result.step_id))
        if problem is not None:  # dropped; its step is refused instead (resync)
            self.link.num_dropped_frames += 1
            log.error("dropped a malformed step result", step_id=result.step_id, error=problem)
            result = pb.StepResult(
                incarnation=result.incarnation, step_id=result.step_id,
                error_code=pb.STEP_ERROR_CODE_MALFORMED_RESULT,
                error_message=f"the executor's result was malformed: {problem}")
            columns = ([], [])  # the refusal's: it applies no sample
        self._inflight.answer(result, columns)

    def _on_lost(self) -> None:
        """The link saw the executor's connection go."""
        log.error("executor disconnected")
        self._lose_executor()

    def _lose_executor(self) -> None:
        if self._inflight.fail_all():
            pass  # _step notices and detaches
        elif self.executor is not None and self._pending_hello is None:
            self._detach()

    async def _heartbeats(self) -> None:
        """While idle, probe the executor: a hung one stops answering."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            self.gc.collect_if_due()  # the step loop is suspended: idle, or awaiting an answer
            self._probe_standby()
            ex = self.executor
            if ex is None or self._stepping:
                continue
            if time.monotonic() - self.link.last_seen > self.heartbeat_timeout_s:
                log.error("executor stopped answering heartbeats", incarnation=ex.incarnation)
                self._lose_executor()
            elif not self.link.send_heartbeat(ex.incarnation, self.steps.num_steps):
                self._lose_executor()

    def _probe_standby(self) -> None:
        """A standby that stopped answering would only hang the takeover: dropped (and
        named as lost, so a supervisor kills and replaces it)."""
        link = self.link
        if link.standby is not None and \
                time.monotonic() - link.standby_last_seen > self.heartbeat_timeout_s:
            self.last_lost_executor_pid = link.drop_standby("it stopped answering").pid
        link.probe_standby()

    def _take_over_from_standby(self) -> None:
        hello = self.link.promote_standby()
        if hello is None:
            return
        log.warning("the warm standby executor takes over", incarnation=hello.incarnation,
                    pid=hello.pid)
        self.num_standby_takeovers += 1
        self._untried_standby = True
        self._pending_hello = hello
        self.link.send_heartbeat(hello.incarnation, 0)
        self._wake.set()

    def _attach_pending_executor(self) -> None:
        hello, self._pending_hello = self._pending_hello, None
        self._inflight.void_all()
        self.deadlines.reset(hello.prefill_tokens_per_s)
        self.executor = self.last_executor = ExecutorInfo.from_hello(hello)
        self.core.attach_executor(self.executor.model)

    # -- the step loop ------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                if self._pending_hello is not None:
                    self._attach_pending_executor()
                if self.executor is None or not (self.core.has_work() or self._inflight):
                    break
                if not await self._step():
                    break
                await asyncio.sleep(0)  # let RPC handlers run between steps

    async def _step(self) -> bool:
        """Sends plans until ``depth`` are in flight, then applies the oldest answer.
        False when there is nothing more to do until woken."""
        self._send_plans()
        if not len(self._inflight):
            return False
        item = self._inflight.oldest()
        self.gc.collect_if_due(waiting=not item.answer.done())  # the executor computes
        self._stepping = True
        try:
            result, why = await await_answer(item.answer, self.deadlines,
                                             item.out.num_batched_tokens, self.executor.pid)
        finally:
            self._stepping = False
        if why:
            log.error("executor missed its step deadline", step_id=item.out.step_id, why=why)
        why = why or "the executor was lost during the step"
        if result is None:
            # It ran the step and hung or died in it; but a standby lost before it answered
            # anything may have been dead already (killed with the executor): not blamed.
            if item.sent and not self._untried_standby:
                self.faults.failed(item.out, why)
            self._inflight.void_all()
            if self._pending_hello is None:
                self._detach()
            return False
        self._inflight.pop_oldest()
        self._untried_standby = False
        if result.error_code:
            self.faults.refused(item.out, result)
            self._inflight.void_all()  # built on what the executor refused
            return True
        self.faults.stood()
        out = item.out
        now, elapsed = self.steps.answered(out, item.sent_at, result.idle_ms)
        self.deadlines.observe(elapsed, out.num_batched_tokens)
        self.core.observe_step(out, elapsed)  # the SLO-aware budget's step-time fit
        if result.row_failures:  # ended before their placeholder samples could apply
            self.faults.rows_failed(result)
        events = self.core.update(out, *item.columns)
        self._dispatch(with_logprobs(events, result) if result.logprobs else events)
        if self.recorder is not None:
            self.recorder.step(out, now - item.sent_at, self.core)
        return True

    def _send_plans(self) -> None:
        # While a suspect awaits its step of its own, nothing else may be in flight.
        depth = 2 if self.core.config.async_scheduling and not self.core.isolating else 1
        while (len(self._inflight) < depth and self.executor is not None
               and self._pending_hello is None):
            out = self.core.schedule()
            self._dispatch(self.core.take_events())
            if out.is_empty:
                return
            frame = self._plans.frame(out, self.executor.incarnation, self.core.block_manager)
            item = self._inflight.add(out)
            if not self.link.send_plan(frame):
                item.sent = False
                item.answer.set_result(None)  # unreachable: lost, like a dead executor
                return

    def _detach(self) -> None:
        """Drop the incarnation: free every device block; running requests wait
        (for recompute) until a new executor says Hello."""
        log.error("executor lost; running requests wait for a new executor",
                  incarnation=self.executor.incarnation if self.executor else None)
        self.num_executor_losses += 1
        self.last_lost_executor_pid = self.executor.pid if self.executor else 0
        self._inflight.void_all()
        self.core.detach_executor()
        self.executor = None
        self.link.peer = None
        self._take_over_from_standby()

"""The one loop that owns the scheduler core (STYLE habit 7).

RPC handlers never touch the core directly while a step is being built:
they call ``submit``/``abort`` (which only queue work and wake the loop) and
read their request's event queue. Everything runs on one asyncio event loop,
so there are no locks.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time

import structlog

from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import (
    CostModel,
    Event,
    ModelInfo,
    Request,
    Scheduler,
    SchedulerConfig,
)
from scheduler_svc.inflight import InFlightPlans
from scheduler_svc.link import ExecutorLink
from scheduler_svc.logprobs import with_logprobs
from scheduler_svc.plan import build_plan_message
from scheduler_svc.plan import prepare as prepare_plan_entry

log = structlog.get_logger("scheduler.loop")

# A step is late (the executor is hung) after STEP_DEADLINE_FLOOR_S plus
# STEP_DEADLINE_FACTOR × its expected time: its tokens at the executor's
# measured prefill rate, plus the recent decode step time.
STEP_DEADLINE_FLOOR_S = 5.0
STEP_DEADLINE_FACTOR = 4.0
# Idle: a heartbeat every HEARTBEAT_S; no answer within HEARTBEAT_TIMEOUT_S
# means the executor is hung.
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0


@dataclasses.dataclass
class ExecutorInfo:
    incarnation: str
    model_id: str
    model: ModelInfo
    pid: int


class EngineLoop:
    """Drives schedule → plan → executor → update.

    With ``async_scheduling`` two plans are in flight: step N+1 is built and sent while
    step N runs, so the executor never waits for the scheduler's CPU (the core schedules
    ahead, see Scheduler.schedule). Without it, one step at a time.
    """

    def __init__(self, config: SchedulerConfig, ipc_address: str) -> None:
        self.core = Scheduler(config)
        self.link = ExecutorLink(ipc_address, self._on_hello, self._on_result,
                                 self._on_lost)
        self.executor: ExecutorInfo | None = None
        self.num_steps = 0
        # For the policy comparison: decode steps, and those that also carried prefill.
        self.num_decode_steps = 0
        self.num_stalled_decode_steps = 0
        self.num_stalled_prefill_tokens = 0
        self._streams: dict[str, asyncio.Queue[Event]] = {}
        self._seq_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._pending_hello: pb.Hello | None = None
        self._inflight = InFlightPlans()
        self._last_answer_at = 0.0
        self._recent_step_s = 0.0  # EMA of step wall time
        # The executor's idle time before each plan (StepResult.idle_ms), for benchmarks.
        self.executor_idle_ms: collections.deque[float] = collections.deque(maxlen=100_000)
        self._stepping = False
        self.draining = False  # set on SIGTERM: Submit is refused
        self.num_executor_losses = 0
        self.last_lost_executor_pid = 0
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        self.link.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run()), loop.create_task(self._heartbeats())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.link.close()

    @property
    def has_work(self) -> bool:
        return self.core.has_work()

    # -- commands from RPC handlers ----------------------------------------------

    def submit(self, req: Request) -> asyncio.Queue[Event]:
        """Queues ``req``; raises QueueFull when a queue cap is reached."""
        req.seq_id = next(self._seq_ids)
        self.core.add_request(req)
        prepare_plan_entry(req)  # now, not in the step that admits it
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._streams[req.request_id] = queue
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> bool:
        """Idempotent. The blocks are free before the next plan is built."""
        event = self.core.abort(request_id)
        if event is not None:
            self._dispatch([event])
            self._wake.set()
        return event is not None

    def is_known(self, request_id: str) -> bool:
        return request_id in self._streams

    # -- executor messages -------------------------------------------------------

    def _on_hello(self, identity: bytes, hello: pb.Hello) -> None:
        log.info(
            "executor registered",
            incarnation=hello.incarnation,
            model=hello.model_id,
            blocks=hello.num_device_blocks,
            block_size=hello.block_size,
            prefill_tokens_per_s=round(hello.prefill_tokens_per_s),
        )
        self._pending_hello = hello
        # Acknowledge, so the executor stops re-sending its Hello.
        self.link.send_heartbeat(hello.incarnation, 0)
        self._inflight.fail_all()  # the old incarnation's steps will never answer
        self._wake.set()

    def _on_result(self, result: pb.StepResult) -> None:
        if self.executor is None or result.incarnation != self.executor.incarnation:
            return  # a stale incarnation's answer
        self._inflight.answer(result)

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
            ex = self.executor
            if ex is None or self._stepping:
                continue
            if time.monotonic() - self.link.last_seen > HEARTBEAT_TIMEOUT_S:
                log.error("executor stopped answering heartbeats", incarnation=ex.incarnation)
                self._lose_executor()
            elif not self.link.send_heartbeat(ex.incarnation, self.num_steps):
                self._lose_executor()

    def _attach_pending_executor(self) -> None:
        hello, self._pending_hello = self._pending_hello, None
        self._inflight.void_all()
        model = ModelInfo(
            block_size=hello.block_size,
            num_blocks=hello.num_device_blocks,
            max_model_len=hello.max_model_len,
            vocab_size=hello.vocab_size,
            eos_token_ids=frozenset(hello.eos_token_ids),
            num_host_blocks=hello.num_host_blocks,
            cost=CostModel(hello.prefill_tokens_per_s, hello.swap_bytes_per_s,
                           hello.block_bytes),
        )
        self.core.attach_executor(model)
        self.executor = ExecutorInfo(hello.incarnation, hello.model_id, model, hello.pid)

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
        self._stepping = True
        try:
            deadline = self._step_deadline(item.out.num_batched_tokens)
            try:
                result = await asyncio.wait_for(item.answer, deadline)
            except TimeoutError:
                log.error("executor missed its step deadline", step_id=item.out.step_id,
                          deadline_s=round(deadline, 1))
                result = None
        finally:
            self._stepping = False
        if result is None:
            self._inflight.void_all()
            if self._pending_hello is None:
                self._detach()
            return False
        self._inflight.pop_oldest()
        if result.error_code:
            log.error("executor refused plan; resynchronizing", code=result.error_code,
                      message=result.error_message)
            self._inflight.void_all()  # built on what the executor refused
            self.core.resync()
            return True
        out = item.out
        now = time.monotonic()
        if out.num_prefill_tokens == 0:  # it started when sent or when the last one ended
            elapsed = now - max(item.sent_at, self._last_answer_at)
            self._recent_step_s = 0.8 * self._recent_step_s + 0.2 * elapsed
        self._last_answer_at = now
        self.num_steps += 1
        if out.num_batched_tokens > out.num_prefill_tokens:  # some sequence decoded
            self.num_decode_steps += 1
            if out.num_prefill_tokens:  # ...and waited for prompt work in the same step
                self.num_stalled_decode_steps += 1
                self.num_stalled_prefill_tokens += out.num_prefill_tokens
        self.executor_idle_ms.append(result.idle_ms)
        events = self.core.update(out, result.seq_ids, result.token_ids)
        self._dispatch(with_logprobs(events, result) if result.logprobs else events)
        return True

    def _send_plans(self) -> None:
        depth = 2 if self.core.config.async_scheduling else 1
        while (len(self._inflight) < depth and self.executor is not None
               and self._pending_hello is None):
            out = self.core.schedule()
            self._dispatch(self.core.take_events())
            if out.is_empty:
                return
            msg = build_plan_message(out, self.executor.incarnation, self.core.block_manager)
            item = self._inflight.add(out)
            if not self.link.send_plan(msg):
                item.answer.set_result(None)  # unreachable: lost, like a dead executor
                return

    def _step_deadline(self, num_tokens: int) -> float:
        rate = self.executor.model.cost.prefill_tokens_per_s or 100.0
        expected = num_tokens / rate + self._recent_step_s
        return STEP_DEADLINE_FLOOR_S + STEP_DEADLINE_FACTOR * expected

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

    def _dispatch(self, events: list[Event]) -> None:
        streams = self._streams
        for ev in events:
            req, _, reason = ev[:3]
            queue = streams.get(req.request_id)
            if queue is None:
                continue
            queue.put_nowait(ev)
            if reason is not None:
                del streams[req.request_id]

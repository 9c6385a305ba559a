"""The one loop that owns the scheduler core (STYLE habit 7).

RPC handlers never touch the core directly while a step is being built:
they call ``submit``/``abort`` (which only queue work and wake the loop) and
read their request's event queue. Everything runs on one asyncio event loop,
so there are no locks.
"""

from __future__ import annotations

import asyncio
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
from scheduler_svc.link import ExecutorLink
from scheduler_svc.plan import build_plan

log = structlog.get_logger("scheduler.loop")

# A step that takes longer than this (and than STEP_DEADLINE_FACTOR × the
# slowest recent step) means the executor is gone or hung.
STEP_DEADLINE_FLOOR_S = 60.0
STEP_DEADLINE_FACTOR = 20.0


@dataclasses.dataclass
class ExecutorInfo:
    incarnation: str
    model_id: str
    model: ModelInfo


class EngineLoop:
    """Drives schedule → plan → executor → update, one step at a time."""

    def __init__(self, config: SchedulerConfig, ipc_address: str) -> None:
        self.core = Scheduler(config)
        self.link = ExecutorLink(ipc_address, self._on_hello, self._on_result)
        self.executor: ExecutorInfo | None = None
        self.num_steps = 0
        self._streams: dict[str, asyncio.Queue[Event]] = {}
        self._seq_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._pending_hello: pb.Hello | None = None
        self._result: asyncio.Future[pb.StepResult | None] | None = None
        self._expected_step = 0
        self._slowest_recent_step = 0.0
        self._task: asyncio.Task | None = None

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        self.link.start()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.link.close()

    # -- commands from RPC handlers ----------------------------------------------

    def submit(self, req: Request) -> asyncio.Queue[Event]:
        """Queues ``req``; raises QueueFull when a queue cap is reached."""
        req.seq_id = next(self._seq_ids)
        self.core.add_request(req)
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
        if self._result is not None and not self._result.done():
            self._result.set_result(None)  # the old incarnation's step will never answer
        self._wake.set()

    def _on_result(self, result: pb.StepResult) -> None:
        fut = self._result
        if self.executor is None or result.incarnation != self.executor.incarnation:
            return  # a stale incarnation's answer
        if fut is not None and not fut.done() and result.step_id == self._expected_step:
            fut.set_result(result)

    def _attach_pending_executor(self) -> None:
        hello, self._pending_hello = self._pending_hello, None
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
        self.executor = ExecutorInfo(hello.incarnation, hello.model_id, model)

    # -- the step loop ------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                if self._pending_hello is not None:
                    self._attach_pending_executor()
                if self.executor is None or not self.core.has_work():
                    break
                if not await self._step():
                    break
                await asyncio.sleep(0)  # let RPC handlers run between steps

    async def _step(self) -> bool:
        """One iteration; False when there is nothing more to do until woken."""
        out = self.core.schedule()
        self._dispatch(self.core.take_events())
        if out.is_empty:
            return False
        plan = build_plan(out, self.executor.incarnation, self.core.block_manager)
        self._expected_step = out.step_id
        self._result = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        result = None
        if self.link.send_plan(plan):
            try:
                result = await asyncio.wait_for(self._result, self._step_deadline())
            except TimeoutError:
                log.error("executor step deadline passed", step_id=out.step_id)
        if result is None:
            self._executor_lost()
            return False
        if result.error_code:
            log.error("executor refused plan; resynchronizing", code=result.error_code,
                      message=result.error_message)
            self.core.resync()
            return True
        self._slowest_recent_step = max(0.9 * self._slowest_recent_step,
                                        time.monotonic() - started)
        self.num_steps += 1
        self._dispatch(self.core.update(out, result.seq_ids, result.token_ids))
        return True

    def _step_deadline(self) -> float:
        return max(STEP_DEADLINE_FLOOR_S, STEP_DEADLINE_FACTOR * self._slowest_recent_step)

    def _executor_lost(self) -> None:
        if self._pending_hello is not None:
            return  # a new incarnation already said hello; it takes over
        log.error("executor lost; running requests wait for a new executor")
        self.core.detach_executor()
        self.executor = None
        self.link.peer = None

    def _dispatch(self, events: list[Event]) -> None:
        streams = self._streams
        for ev in events:
            req, _, reason = ev
            queue = streams.get(req.request_id)
            if queue is None:
                continue
            queue.put_nowait(ev)
            if reason is not None:
                del streams[req.request_id]

"""The discrete-event loop: the real scheduler core, a virtual clock, a cost model.

Each iteration: requests that arrived by ``now`` are submitted (a full queue
refuses them with ``QueueFull``, as in the service); ``Scheduler.schedule()``
builds the step; the cost model prices it; the clock jumps by that much; every
sequence the step completes samples a token, fed back through
``Scheduler.update()`` exactly as the executor's StepResult would be. When
nothing is running or waiting the clock jumps to the next arrival. No sleeping,
no processes, no threads.

Sampled tokens are a fixed non-EOS id and ``max_tokens`` is the trace's output
length, so each request stops by length after exactly its traced output.
Scheduling is synchronous (one plan in flight): the simulator models the device,
and the scheduler's own CPU time is inside the cost model's per-step overhead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from scheduler_svc.core import (
    CostModel,
    ModelInfo,
    QueueFull,
    Request,
    Scheduler,
    SchedulerConfig,
)
from sim.cost_model import StepCostModel
from sim.workload import TraceRequest

EOS = 2
SAMPLED = 1000  # every sampled token: never EOS, so only max_tokens ends a request
PROMPT = 7  # prompt contents do not matter: prefix caching is off in the simulator
BLOCK_SIZE = 16
MAX_MODEL_LEN = 16384  # Llama-3.3-70B allows 128 k; the trace's longest request is 14,089
VOCAB = 128256


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """What a client of one request saw, in simulated seconds."""

    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    klass: str
    priority_tier: int
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    rejected: str | None = None  # why the service refused it
    token_times: list[float] | None = None

    def timing(self) -> tuple:
        """The tuple ``sim.metrics.summarize`` reads."""
        return (self.arrival_s, self.first_token_s, self.finish_s, self.num_output_tokens,
                self.token_times)


@dataclasses.dataclass
class SimResult:
    records: list[RequestRecord]
    end_s: float  # simulated time when the last step ended
    wall_s: float  # real seconds the simulation took
    num_steps: int
    num_decode_steps: int  # steps that advanced at least one decode
    num_stalled_decode_steps: int  # ... and also carried prefill tokens
    num_preemptions: int
    num_output_tokens: int  # generated, finished or not

    @property
    def finished(self) -> list[RequestRecord]:
        return [r for r in self.records if r.finish_s is not None]

    @property
    def rejected(self) -> list[RequestRecord]:
        return [r for r in self.records if r.rejected is not None]


def policy_config(policy: str, max_num_seqs: int = 128, **overrides) -> SchedulerConfig:
    """The scheduler config each policy is simulated with (overrides win).

    chunked: a 512-token budget per step, decodes included, 512-token chunks (vLLM
        0.6's default with chunked prefill; a 2,048-token step of a 70B model on
        4×A100 takes ≈ 400 ms, which is every running decode's TPOT that step).
    continuous: a budget of the model's context, so a prompt prefills in one step.
    static: a budget that lets one step admit a whole batch (``max_num_seqs`` ×
        2,048 tokens), which then runs to completion before the next is admitted.
    The queue is unbounded unless a cap is given: the simulator measures waiting.
    Prefix caching is off: the trace has no token contents to share.
    """
    budgets = {"chunked": (512, 512), "continuous": (MAX_MODEL_LEN, 512),
               "static": (max_num_seqs * 2048, 512)}
    if policy not in budgets:
        raise ValueError(f"policy must be one of {', '.join(budgets)}, got {policy!r}")
    budget, chunk = budgets[policy]
    fields = dict(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                  chunk_size=chunk, max_num_waiting=1_000_000, enable_prefix_caching=False)
    fields.update(overrides)
    return SchedulerConfig(**fields)


class _Clock:
    """The virtual clock the scheduler reads (aging, preemption windows)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Simulation:
    """One run of ``requests`` through a scheduler built from ``config``."""

    def __init__(self, requests: Sequence[TraceRequest], config: SchedulerConfig,
                 cost: StepCostModel, record_token_times: bool = False) -> None:
        self.requests = requests
        self.cost = cost
        self.clock = _Clock()
        self.sched = Scheduler(config, clock=self.clock)
        self.sched.attach_executor(ModelInfo(
            BLOCK_SIZE, cost.num_kv_blocks(BLOCK_SIZE), MAX_MODEL_LEN, VOCAB,
            frozenset({EOS}), num_host_blocks=0, cost=CostModel()))  # preemption: recompute
        self.records = [RequestRecord(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens,
                                      r.klass, r.priority_tier,
                                      token_times=[] if record_token_times else None)
                        for r in requests]
        self.num_output_tokens = 0

    def _submit(self, i: int) -> None:
        tr, rec = self.requests[i], self.records[i]
        problem = self.sched.admission_problem(tr.num_prompt_tokens, tr.num_output_tokens)
        if problem:
            rec.rejected = problem
            return
        req = Request(request_id=str(i), seq_id=i, token_ids=[PROMPT] * tr.num_prompt_tokens,
                      num_prompt_tokens=tr.num_prompt_tokens, max_tokens=tr.num_output_tokens,
                      tenant=tr.tenant, priority_tier=tr.priority_tier,
                      arrival_time=tr.arrival_s)
        try:
            self.sched.add_request(req)
        except QueueFull as exc:
            rec.rejected = str(exc)

    def run(self, max_sim_s: float = float("inf")) -> SimResult:
        """Until every request is done, or the clock passes ``max_sim_s``."""
        start = time.perf_counter()
        sched, clock, cost, records = self.sched, self.clock, self.cost, self.records
        arrivals = [r.arrival_s for r in self.requests]
        n, i = len(arrivals), 0
        steps = decode_steps = stalled = 0
        while clock.now < max_sim_s:
            while i < n and arrivals[i] <= clock.now:
                self._submit(i)
                i += 1
            if not sched.has_work():
                if i >= n:
                    break
                clock.now = arrivals[i]
                continue
            out = sched.schedule()
            pairs, sampled = [], []
            num_decodes = 0
            for req, q, _ in out.scheduled():
                computed = req.num_computed_tokens
                pairs.append((q, computed - q))
                num_decodes += q == 1 and computed > req.num_prompt_tokens
                if computed == len(req.token_ids):
                    sampled.append(req.seq_id)
            if not pairs and not out.finished_seq_ids:
                # Nothing fits and nothing runs to free room: wait for the next arrival.
                for event in sched.take_events():
                    self._record(event)
                if i >= n:
                    break
                clock.now = max(clock.now, arrivals[i])
                continue
            steps += 1
            if num_decodes:
                decode_steps += 1
                stalled += out.num_prefill_tokens > 0
            clock.now += cost.step_time(pairs, len(sampled))
            for event in sched.update(out, sampled, [SAMPLED] * len(sampled)):
                self._record(event)
        return SimResult(records, clock.now, time.perf_counter() - start, steps, decode_steps,
                         stalled, sched.num_preemptions, self.num_output_tokens)

    def _record(self, event) -> None:
        """One core event: (request, token or None, finish reason or None[, logprob]);
        read by position, so a 3-tuple and the core's Event both work."""
        req, token, reason = event[0], event[1], event[2]
        rec = self.records[req.seq_id]
        now = self.clock.now
        if token is not None:
            if rec.first_token_s is None:
                rec.first_token_s = now
            rec.num_output_tokens += 1
            self.num_output_tokens += 1
            if rec.token_times is not None:
                rec.token_times.append(now)
        if reason is not None:
            if req.error:
                # Shed from the queue (overload, core/admission.py): the client is told
                # RESOURCE_EXHAUSTED and saw no token, so it counts as refused, not served.
                rec.rejected = req.error
            else:
                rec.finish_s = now

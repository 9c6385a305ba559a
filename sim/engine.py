"""The discrete-event loop: the real scheduler core, a virtual clock, a cost model.

Each iteration submits the requests that arrived by ``now`` (``QueueFull`` refuses, as
in the service), ``Scheduler.schedule()`` builds the step, the cost model prices it, the
clock jumps by that much, and every sampling sequence's token goes back through
``Scheduler.update()`` as a StepResult would; idle, the clock jumps to the next arrival.
No sleeping, processes or threads. Tokens are a fixed non-EOS id and ``max_tokens`` the
trace's output length. ``pipeline_depth=2`` keeps two plans in flight as
``async_scheduling`` does; the scheduler's own CPU time is in the per-step overhead.

Prefix caching is on, as in the server: prompts are the trace row's ``prompt_ids`` when
given (``sim.prefix_trace``), else unique ids. Swap preemption runs when the cost model
has a host pool (``host_kv_blocks``), priced by ``swap_time``.
"""

from __future__ import annotations

import collections
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
    SchedulerOutput,
)
from scheduler_svc.core.config import QUEUE_TIME_FIELDS, TPOT_TARGET_FIELDS
from scheduler_svc.core.policy import POLICIES
from sim.cost_model import StepCostModel
from sim.workload import TraceRequest

EOS = 2
SAMPLED = 1000  # every sampled token: never EOS, so only max_tokens ends a request
_ID_SPAN = 128253  # ids 3..128255: the first block is unique per request below this many
BLOCK_SIZE = 16
MAX_MODEL_LEN = 16384  # Llama-3.3-70B allows 128 k; the trace's longest request is 14,089
VOCAB = 128256
# chunked-slo at 70B / 4xA100: a decode-only step is 35-60 ms (docs/design.md §7), so 100 ms
# leaves room for ~300 prompt tokens a step; at 70 ms prefill starves at 0.4x the trace
# (TTFT p99 10 s, docs/capacity/README.md). The ceiling lets a lone prompt prefill in one
# step when nothing decodes.
SLO_TPOT_TARGET_MS = 100.0
SLO_BUDGET = 4096


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
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    first_scheduled: float | None = None

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
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    busy_s: float = 0.0  # the steps' own time (end_s less the idle waits for arrivals)
    num_step_seqs: int = 0  # sequences over all steps (÷ num_steps: the mean batch)
    num_prefill_tokens: int = 0  # prompt tokens computed over all steps

    @property
    def prefix_hit_tokens(self) -> int:
        return sum(r.prefix_hit_tokens for r in self.records)

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
    chunked-slo: chunked with the SLO-aware budget (core/step_cost.py): every tier's
        TPOT target ``SLO_TPOT_TARGET_MS``, under a ``SLO_BUDGET``-token ceiling, sizes
        each step's prompt work from the online step-time fit.
    static: a budget that lets one step admit a whole batch (``max_num_seqs`` ×
        2,048 tokens), which then runs to completion before the next is admitted.
    Any other registered policy (core/policy.py) is simulated with the budget of the
    nearest of these it derives from (sjf: chunked's), and with the TPOT targets when
    it uses them.
    The queue is unbounded unless a cap is given: the simulator measures waiting (the
    core's queue-time shedding, on by default in the service, is off here for that reason;
    pass ``max_queue_time_*_s`` to simulate it).
    Prefix caching is on, as in the server (prompts share only what their ids share).
    """
    budgets = {"chunked": (512, 512), "continuous": (MAX_MODEL_LEN, 512),
               "static": (max_num_seqs * 2048, 512), "chunked-slo": (SLO_BUDGET, 512)}
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    cls = POLICIES[policy]
    budget, chunk = next(budgets[c.name] for c in cls.__mro__ if c.name in budgets)
    slo = dict.fromkeys(TPOT_TARGET_FIELDS, SLO_TPOT_TARGET_MS) if cls.uses_tpot_targets else {}
    fields = dict(policy=policy, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=budget, **slo,
                  chunk_size=chunk, max_num_waiting=1_000_000, enable_prefix_caching=True,
                  **dict.fromkeys(QUEUE_TIME_FIELDS, 0.0))
    fields.update(overrides)
    return SchedulerConfig(**fields)


class _Clock:
    """The virtual clock the scheduler reads (aging, preemption windows)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass(slots=True)
class _Step:
    """A plan in flight: what it samples, what it costs, when the executor ends it."""

    out: SchedulerOutput
    sampled: list[int]
    compute_s: float  # the cost model's step time
    seconds: float  # ... plus any swap copies
    ends_s: float = 0.0


@dataclasses.dataclass(slots=True)
class _Counts:
    steps: int = 0
    decode_steps: int = 0  # steps that advanced at least one decode
    stalled: int = 0  # ... and also carried prefill tokens
    swapped_out: int = 0
    swapped_in: int = 0
    busy_s: float = 0.0
    step_seqs: int = 0
    prefill: int = 0


class Simulation:
    """One run of ``requests`` through a scheduler built from ``config``."""

    def __init__(self, requests: Sequence[TraceRequest], config: SchedulerConfig,
                 cost: StepCostModel, record_token_times: bool = False,
                 num_blocks: int | None = None, num_host_blocks: int | None = None,
                 max_model_len: int = MAX_MODEL_LEN, vocab: int = VOCAB,
                 pipeline_depth: int = 1) -> None:
        """``num_blocks`` / ``num_host_blocks``: the device and host pools in blocks
        (default: what the cost model's memory holds; a cost model without
        ``host_kv_blocks`` has no host pool, so preemption recomputes).
        ``pipeline_depth``: plans in flight, as the service loop keeps them (2 with
        ``async_scheduling``: step N+1 is built when step N is sent, so a request that
        arrives during step N waits for N+1 too); 1, one step at a time."""
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth {pipeline_depth}: at least 1")
        self.pipeline_depth = pipeline_depth
        self.requests = requests
        self.cost = cost
        self.clock = _Clock()
        self.sched = Scheduler(config, clock=self.clock)
        if num_host_blocks is None:
            host = getattr(cost, "host_kv_blocks", None)
            num_host_blocks = host(BLOCK_SIZE) if host else 0
        core_cost = getattr(cost, "core_cost_model", None)
        self.sched.attach_executor(ModelInfo(
            BLOCK_SIZE, num_blocks or cost.num_kv_blocks(BLOCK_SIZE), max_model_len, vocab,
            frozenset({EOS}), num_host_blocks=num_host_blocks,
            cost=core_cost(BLOCK_SIZE) if core_cost and num_host_blocks else CostModel()))
        self._swap_time = getattr(cost, "swap_time", None)
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
        ids = (list(tr.prompt_ids) if tr.prompt_ids is not None else
               [3 + (i * 7919 + j) % _ID_SPAN for j in range(tr.num_prompt_tokens)])
        req = Request(request_id=str(i), seq_id=i, token_ids=ids,
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
        sched, clock, records = self.sched, self.clock, self.records
        arrivals = [r.arrival_s for r in self.requests]
        n, i = len(arrivals), 0
        inflight: collections.deque[_Step] = collections.deque()
        free_at = 0.0  # when the executor is done with the steps in flight
        self._counts = counts = _Counts()
        while clock.now < max_sim_s:
            while i < n and arrivals[i] <= clock.now:
                self._submit(i)
                i += 1
            # As the service loop's _send_plans: plans are built until ``depth`` are in
            # flight; the executor runs them one after another.
            while len(inflight) < self.pipeline_depth and sched.has_work():
                step = self._plan()
                if step is None:
                    break
                free_at = step.ends_s = max(clock.now, free_at) + step.seconds
                inflight.append(step)
            if not inflight:  # nothing runs: wait for the next arrival
                if i >= n:
                    break
                clock.now = max(clock.now, arrivals[i])
                continue
            step = inflight.popleft()
            clock.now = step.ends_s
            sched.observe_step(step.out, step.compute_s)  # the SLO budget's fit, as served
            for event in sched.update(step.out, step.sampled, [SAMPLED] * len(step.sampled)):
                self._record(event)
        c = counts
        return SimResult(records, clock.now, time.perf_counter() - start, c.steps,
                         c.decode_steps, c.stalled, sched.num_preemptions,
                         self.num_output_tokens, c.swapped_out, c.swapped_in, c.busy_s,
                         c.step_seqs, c.prefill)

    def _plan(self) -> _Step | None:
        """The next plan, priced; None when nothing fits and nothing runs to free room."""
        sched, clock, records, c = self.sched, self.clock, self.records, self._counts
        out = sched.schedule()
        pairs, sampled = [], []
        num_decodes = 0
        for req, q, _ in out.scheduled():
            computed = req.num_computed_tokens
            pairs.append((q, computed - q))
            rec = records[req.seq_id]
            if rec.first_scheduled is None:  # admission: what the prefix cache held
                rec.first_scheduled = clock.now
                rec.prefix_hit_tokens = computed - q
            num_decodes += q == 1 and computed > req.num_prompt_tokens
            # Samples when it reaches its last token; scheduled ahead of an unanswered
            # step, a decode is one past the history (the pending sample's).
            if computed >= len(req.token_ids):
                sampled.append(req.seq_id)
        if not pairs and not out.finished_seq_ids:
            for event in sched.take_events():
                self._record(event)
            return None
        c.steps += 1
        if num_decodes:
            c.decode_steps += 1
            c.stalled += out.num_prefill_tokens > 0
        compute = self.cost.step_time(pairs, len(sampled))
        seconds = compute
        if out.swap_out or out.swap_in:
            c.swapped_out += len(out.swap_out)
            c.swapped_in += len(out.swap_in)
            seconds += self._swap_time(len(out.swap_out) + len(out.swap_in), BLOCK_SIZE)
        c.busy_s += seconds
        c.step_seqs += len(pairs)
        c.prefill += out.num_prefill_tokens
        return _Step(out, sampled, compute, seconds)

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

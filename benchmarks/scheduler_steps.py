"""The scheduler on bench_scheduler's workload, stepped without a model: the workload,
a scheduler sized for it, and a Stepper that times one step's phases (schedule, building
the plan, serializing it, applying the result), for bench_scheduler and bench_channel."""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics
import time
import types

import scheduler_svc.core
import scheduler_svc.plan
from protos import seq_columns, wire
from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import Request
from scheduler_svc.core.config import QUEUE_TIME_FIELDS
from scheduler_svc.gc_pacing import GcPacer
from sim.metrics import percentile

SYSTEM_PROMPT = list(range(1000, 1064))
BLOCK_SIZE = 16  # the executor's default (--block-size)
PHASES = ("schedule", "plan", "serialize", "update", "executor_parse")
WARMUP = 50
# Garbage collection as the scheduler process runs it once PACER takes over (bench_scheduler
# does, unless --gc auto): between steps, where the serving loop awaits the executor.
PACER = GcPacer()


def scheduler_api(core, plan) -> types.SimpleNamespace:
    """What the benchmark uses of a scheduler package (its ``core`` and ``plan``
    modules): one plan builder's ``prepare`` and ``frame`` (its bytes: the "serialize"
    phase is then empty) or ``message`` where ``plan`` has a PlanBuilder (it owns the
    prompts' wire form), else its module functions (revisions before ``plan.prepare``
    lack that one)."""
    builder = plan.PlanBuilder() if hasattr(plan, "PlanBuilder") else None
    if builder is not None and hasattr(builder, "frame"):  # it writes the bytes itself
        build, serialize = builder.frame, _same
    else:
        build = plan.build_plan_message if builder is None else builder.message
        serialize = _serialized
    # Its answers as the executor of its revision sends them: seq ids packed where the
    # core checks them as bytes (StepRecord.sampler_bytes), else the plain column.
    record = getattr(getattr(core, "plan", None), "StepRecord", None)
    packed = "sampler_bytes" in getattr(record, "__slots__", ())
    return types.SimpleNamespace(
        Request=core.Request, Scheduler=core.Scheduler, SchedulerConfig=core.SchedulerConfig,
        ModelInfo=core.ModelInfo, QueueFull=core.QueueFull,
        encode_plan=build, serialize=serialize,
        prepare=getattr(plan, "prepare", None) if builder is None else builder.prepare,
        result=_packed_result if packed else _plain_result,
        columns=wire.result_columns if packed else _plain_columns)


def _packed_result(seq_ids: list[int], token_ids: list[int]) -> pb.StepResult:
    return pb.StepResult(packed_seq_ids=seq_columns.pack(seq_ids), token_ids=token_ids)


def _plain_result(seq_ids: list[int], token_ids: list[int]) -> pb.StepResult:
    return pb.StepResult(seq_ids=seq_ids, token_ids=token_ids)


def _plain_columns(result: pb.StepResult):
    return result.seq_ids, result.token_ids  # the revision's update reads them itself


def _same(frame: bytes) -> bytes:
    return frame


def _serialized(message) -> bytes:
    return message.SerializeToString()


def current_api() -> types.SimpleNamespace:
    """The working tree's scheduler."""
    return scheduler_api(scheduler_svc.core, scheduler_svc.plan)


class Workload:
    """Requests of the mix: a shared 64-token system prompt, then the request's own
    tokens. Lengths are synthetic (own prompt 16–400 tokens, 8–200 output tokens) or,
    with ``trace``, the Azure conversation trace's (prompt, output) pairs in order
    (prompts mean 1,155 tokens, outputs mean 211)."""

    def __init__(self, request_cls=Request, seed: int = 0,
                 trace: list[tuple[int, int]] | None = None) -> None:
        self.request_cls = request_cls
        self.rng = random.Random(seed)
        self.ids = itertools.count(1)
        self.trace = trace

    @property
    def mean_context(self) -> float:
        """Mean tokens a running sequence holds (prompt + half its output)."""
        if self.trace is None:
            return 64 + 208 + 104
        return statistics.mean(p + o / 2 for p, o in self.trace)

    def request(self, max_tokens: int | None = None):
        i = next(self.ids)
        if self.trace is None:
            own_len, out_len = self.rng.randint(16, 400), self.rng.randint(8, 200)
        else:
            prompt_len, out_len = self.trace[(i - 1) % len(self.trace)]
            own_len = max(1, prompt_len - len(SYSTEM_PROMPT))
        own = [self.rng.randrange(2000, 40000) for _ in range(own_len)]
        prompt = SYSTEM_PROMPT + own
        return self.request_cls(f"r{i}", i, prompt, len(prompt),
                                max_tokens=out_len if max_tokens is None else max_tokens,
                                ignore_eos=True, tenant=f"t{i % 4}", priority_tier=i % 3)


def make_scheduler(num_seqs: int, kv_fraction: float = 0.85, api=None,
                   mean_context: float = 64 + 208 + 104, block_size: int = BLOCK_SIZE):
    api = api or current_api()
    # The bench keeps its queue full by construction: no queue-time bound may refuse
    # (fields an older revision, under --against, may not have).
    names = {f.name for f in dataclasses.fields(api.SchedulerConfig)}
    unbounded = {name: 0 for name in QUEUE_TIME_FIELDS if name in names}
    cfg = api.SchedulerConfig(max_num_seqs=num_seqs,
                              max_num_batched_tokens=max(2048, 2 * num_seqs),
                              chunk_size=512, watermark=0.01, max_num_waiting=100_000,
                              **unbounded)
    sched = api.Scheduler(cfg)
    # A fraction of what the running set would need at its mean length (a sequence's
    # last block is half full on average).
    blocks = int(num_seqs * (mean_context / block_size + 0.5) * kv_fraction)
    sched.attach_executor(api.ModelInfo(block_size, blocks, 16384, 49152, frozenset({2})))
    return sched


class Stepper:
    """One scheduler on the workload. ``decode_only``: ``num_seqs`` requests that never
    finish within the run, all admitted up front (a pool that holds them all), so after
    their prefills every step is ``num_seqs`` decodes and nothing else."""

    def __init__(self, num_seqs: int, kv_fraction: float = 0.85, api=None,
                 decode_only: bool = False, trace: list[tuple[int, int]] | None = None,
                 block_size: int = BLOCK_SIZE) -> None:
        self.api = api or current_api()
        self.work = Workload(self.api.Request, trace=trace)
        self.sched = make_scheduler(num_seqs, 3.0 if decode_only else kv_fraction, self.api,
                                    self.work.mean_context, block_size)
        self.queue = 0 if decode_only else num_seqs // 4  # kept waiting: admissions happen
        if decode_only:
            for _ in range(num_seqs):
                self._arrive(self.work.request(max_tokens=100_000))
        self.timings: dict[str, list[float]] = {k: [] for k in PHASES}
        self.totals: list[float] = []  # each recorded step's schedule..update, µs
        self.tokens = 0
        self.preempts_at_start = 0
        self.last_prefill_tokens = 0

    def _arrive(self, req) -> bool:
        try:
            self.sched.add_request(req)
        except self.api.QueueFull:
            return False
        if self.api.prepare is not None:
            self.api.prepare(req)  # as the scheduler process does on arrival
        return True

    def step(self, record: bool) -> float:
        """One step; with ``record``, its phases are kept. Returns its total in µs."""
        sched = self.sched
        while len(sched.waiting) < self.queue and self._arrive(self.work.request()):
            pass
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        plan = self.api.encode_plan(out, "inc", sched.block_manager)
        t2 = time.perf_counter()
        frame = self.api.serialize(plan)
        t3 = time.perf_counter()
        wire.decode_from_scheduler(frame)
        t4 = time.perf_counter()
        done = [r for r, _, _ in out.scheduled() if r.num_computed_tokens == len(r.token_ids)]
        result = self.api.result([r.seq_id for r in done], [7] * len(done))
        t5 = time.perf_counter()
        sched.update(out, *self.api.columns(result))  # as the loop reads them, timed
        t6 = time.perf_counter()
        self.last_prefill_tokens = out.num_prefill_tokens
        total = (t3 - t0 + t6 - t5) * 1e6
        PACER.collect_if_due()  # where the serving loop collects: the executor computes
        if record:
            self.totals.append(total)
            if not self.timings["schedule"]:
                self.preempts_at_start = sched.num_preemptions
            for key, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t6 - t5, t4 - t3),
                               strict=True):
                self.timings[key].append(dt * 1e6)
            self.tokens += out.num_batched_tokens
        return total

    def summary(self) -> dict[str, float]:
        timings, sched = self.timings, self.sched
        bm = sched.block_manager
        steps = len(timings["schedule"])
        med = {k: statistics.median(v) for k, v in timings.items()}
        med["total"] = med["schedule"] + med["plan"] + med["serialize"] + med["update"]
        med["mean_total"] = statistics.mean(self.totals)
        med["p99"] = percentile(self.totals, 99)
        med["max"] = max(self.totals)
        med["running"] = len(sched.running)
        med["tokens_per_step"] = self.tokens / steps
        med["preemptions"] = sched.num_preemptions - self.preempts_at_start
        med["hit_rate"] = bm.num_cache_hits / max(1, bm.num_cache_queries)
        return med

"""Cost of the scheduler's per-step control path, without any model.

Steady state with N running sequences and a realistic mix: every request
shares a 64-token system prompt (prefix cache), has its own 16–400-token
prompt (chunked prefill) and 8–200 output tokens, so each step has decodes,
prefill chunks, finishes and admissions. Two KV pool sizes: 85 % of what the
running set needs at its mean length (admission keeps the running set full and no
decode has to preempt: the step the targets are about), and 65 % (the "tight"
rows: the pool, not max_num_seqs, limits the running set, and decodes preempt).
Per step it times schedule(), build_plan_message() (core output → protobuf),
serializing the plan frame, and update() (applying the result); the executor side
(parsing the frame) is timed separately. "preempt" counts the timed steps only.

This machine's speed drifts by up to 1.7x between consecutive runs of the same code, so
each row also times a reference the way FACTS.md did (best of repeated runs), before
and after the row: the columnar plan encode at 256 sequences, 24 us on the FACTS.md
machine. "x ref" is the mean of the two over 24 us (how much slower this machine is
right now), and "@ref" is TOTAL divided by it: the figure scaled to the FACTS.md machine.

    make bench-scheduler      # or: .venv/bin/python -m benchmarks.bench_scheduler
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
import timeit

from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import ModelInfo, QueueFull, Request, Scheduler, SchedulerConfig
from scheduler_svc.plan import build_plan_message, prepare

SYSTEM_PROMPT = list(range(1000, 1064))
REFERENCE_US = 24.0  # FACTS.md: protobuf, columnar, encode at 256 sequences


def reference_encode() -> bytes:
    """FACTS.md's "protobuf, columnar" encode: 256 decodes, 1 in 16 adding a block."""
    plan = pb.BatchPlan()
    plan.cached_seq_ids.extend(_REF_IDS)
    plan.cached_num_scheduled_tokens.extend(_REF_ONES)
    plan.cached_num_new_blocks.extend(_REF_NEW)
    plan.cached_new_block_ids.extend(_REF_BLOCKS)
    return plan.SerializeToString()


_REF_IDS = list(range(1000, 1256))
_REF_ONES = [1] * 256
_REF_NEW = [1 if i % 16 == 0 else 0 for i in range(256)]
_REF_BLOCKS = list(range(16))


class Workload:
    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.ids = itertools.count(1)

    def request(self) -> Request:
        i = next(self.ids)
        own = [self.rng.randrange(2000, 40000) for _ in range(self.rng.randint(16, 400))]
        prompt = SYSTEM_PROMPT + own
        return Request(f"r{i}", i, prompt, len(prompt), max_tokens=self.rng.randint(8, 200),
                       ignore_eos=True, tenant=f"t{i % 4}", priority_tier=i % 3)


def make_scheduler(num_seqs: int, kv_fraction: float = 0.85) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, 2 * num_seqs),
                          chunk_size=512, watermark=0.01, max_num_waiting=100_000)
    sched = Scheduler(cfg)
    # A fraction of what the running set would need at its mean length.
    blocks = int(num_seqs * (64 + 208 + 104) / 16 * kv_fraction)
    sched.attach_executor(ModelInfo(16, blocks, 8192, 49152, frozenset({2})))
    return sched


def bench(num_seqs: int, steps: int, kv_fraction: float = 0.85) -> dict[str, float]:
    sched, work = make_scheduler(num_seqs, kv_fraction), Workload()
    timings: dict[str, list[float]] = {"schedule": [], "plan": [], "serialize": [],
                                       "update": [], "executor_parse": []}

    tokens = preempts_at_start = 0
    for i in range(steps + 50):
        if i == 50:
            preempts_at_start = sched.num_preemptions
        while len(sched.waiting) < num_seqs // 4:  # keep a queue so admissions happen
            req = work.request()
            try:
                sched.add_request(req)
            except QueueFull:
                break
            prepare(req)  # as the scheduler process does on arrival
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        plan = build_plan_message(out, "inc", sched.block_manager)
        t2 = time.perf_counter()
        frame = plan.SerializeToString()
        t3 = time.perf_counter()
        wire.decode_from_scheduler(frame)
        t4 = time.perf_counter()
        done = [r for r, _, _ in out.scheduled() if r.num_computed_tokens == len(r.token_ids)]
        result = pb.StepResult(seq_ids=[r.seq_id for r in done], token_ids=[7] * len(done))
        t5 = time.perf_counter()
        sched.update(out, result.seq_ids, result.token_ids)
        t6 = time.perf_counter()
        if i >= 50:  # after warm-up: the running set is full
            for key, dt in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t6 - t5, t4 - t3),
                               strict=True):
                timings[key].append(dt * 1e6)
            tokens += out.num_batched_tokens
    bm = sched.block_manager
    med = {k: statistics.median(v) for k, v in timings.items()}
    med["total"] = med["schedule"] + med["plan"] + med["serialize"] + med["update"]
    med["mean_total"] = sum(statistics.mean(timings[k])
                            for k in ("schedule", "plan", "serialize", "update"))
    med["running"] = len(sched.running)
    med["tokens_per_step"] = tokens / steps
    med["preemptions"] = sched.num_preemptions - preempts_at_start  # in the timed steps
    med["hit_rate"] = bm.num_cache_hits / max(1, bm.num_cache_queries)
    return med


def reference_us() -> float:
    """Best of 5 × 200 reference encodes, in µs each."""
    return min(timeit.repeat(reference_encode, number=200, repeat=5)) / 200 * 1e6


def main() -> None:
    print(f"{'seqs':>5} {'kv':>5} {'running':>7} {'tok/step':>8} {'schedule':>9} {'plan':>6} "
          f"{'serialize':>9} {'update':>7} {'TOTAL p50':>9} {'mean':>6} {'exec parse':>10} "
          f"{'preempt':>7} {'prefix hits':>11} {'x ref':>6} {'@ref':>5}   (µs per step)")
    for n, steps, kv in ((64, 400, 0.85), (256, 300, 0.85), (1024, 100, 0.85),
                         (256, 300, 0.65)):
        before = reference_us()
        r = bench(n, steps, kv)
        speed = (before + reference_us()) / 2 / REFERENCE_US
        r["speed"], r["at_ref"] = speed, r["total"] / speed
        print(f"{n:>5} {kv:>5.0%} {r['running']:>7} {r['tokens_per_step']:>8.0f} "
              f"{r['schedule']:>9.0f} {r['plan']:>6.0f} {r['serialize']:>9.0f} {r['update']:>7.0f} "
              f"{r['total']:>9.0f} {r['mean_total']:>6.0f} {r['executor_parse']:>10.0f} "
              f"{r['preemptions']:>7} {r['hit_rate']:>10.0%} {r['speed']:>6.2f} "
              f"{r['at_ref']:>5.0f}")


if __name__ == "__main__":
    main()

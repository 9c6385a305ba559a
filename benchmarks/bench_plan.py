"""Cost of the scheduler's per-step control path, without any model.

For N running decode sequences (1 in 16 adding a block each step) it times:
schedule() + update() in the core, build_plan() (core output → protobuf), and
encoding + decoding the plan frame. Prints microseconds per step.

    .venv/bin/python -m benchmarks.bench_plan
"""

from __future__ import annotations

import time

from protos import wire
from scheduler_svc.core import ModelInfo, Request, Scheduler, SchedulerConfig
from scheduler_svc.plan import build_plan


def make_running(num_seqs: int) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs * 64),
                          chunk_size=512, watermark=0.0)
    sched = Scheduler(cfg)
    sched.attach_executor(ModelInfo(16, num_seqs * 64, 8192, 49152, frozenset({2})))
    for i in range(num_seqs):
        sched.add_request(Request(f"r{i}", i + 1, list(range(100, 100 + 40 + i % 16)), 40 + i % 16,
                                  max_tokens=10_000, ignore_eos=True))
    out = sched.schedule()  # prefill everyone
    sched.update(out, *sampled(out))
    return sched


def sampled(out):
    reqs = [r for r, _, _ in out.scheduled() if r.num_computed_tokens == r.num_tokens]
    return [r.seq_id for r in reqs], [7] * len(reqs)


def bench(num_seqs: int, steps: int = 300) -> dict[str, float]:
    sched = make_running(num_seqs)
    t_sched = t_build = t_codec = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        plan = build_plan(out, "inc", sched.block_manager)
        t2 = time.perf_counter()
        kind, decoded = wire.decode_from_scheduler(wire.encode_to_executor("plan", plan))
        _ = list(decoded.cached_seq_ids)
        ids, toks = sampled(out)
        t3 = time.perf_counter()
        sched.update(out, ids, toks)
        t4 = time.perf_counter()
        t_sched += (t1 - t0) + (t4 - t3)
        t_build += t2 - t1
        t_codec += t3 - t2
    us = 1e6 / steps
    return {"schedule+update": t_sched * us, "build_plan": t_build * us,
            "encode+decode": t_codec * us}


def main() -> None:
    print(f"{'running seqs':>12} {'schedule+update µs':>19} {'build_plan µs':>14} "
          f"{'encode+decode µs':>17}")
    for n in (64, 256):
        r = bench(n)
        print(f"{n:>12} {r['schedule+update']:>19.0f} {r['build_plan']:>14.0f} "
              f"{r['encode+decode']:>17.0f}")


if __name__ == "__main__":
    main()

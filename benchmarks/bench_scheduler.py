"""Cost of the scheduler's per-step control path, without any model.

Steady state with N running sequences and a realistic mix: every request
shares a 64-token system prompt (prefix cache), has its own 16–400-token
prompt (chunked prefill) and 8–200 output tokens, so each step has decodes,
prefill chunks, finishes and admissions. Two KV pool sizes: 85 % of what the
running set needs at its mean length (admission keeps the running set full and no
decode has to preempt: the step the targets are about), and 65 % (the "tight"
rows: the pool, not max_num_seqs, limits the running set, and decodes preempt).
Per step it times schedule(), the plan frame's encoding (PlanBuilder.frame: core output
→ wire bytes; "serialize" is 0 since it writes them itself, and protobuf's
SerializeToString for a revision whose builder has no ``frame``), and update()
(applying the result); the executor side
(parsing the frame) is timed separately. "preempt" counts the timed steps only.
The "decode-only" row is the floor of the same path: N sequences that only decode
(no admission, finish or prefill), i.e. what the columnar per-decode work costs.
Garbage is collected between steps, as the scheduler process does it
(scheduler_svc/gc_pacing.py); ``--gc auto`` leaves the interpreter's automatic collection
on, which lands inside steps: compare the mean, p99 and max columns.

This machine's speed drifts by up to 2x between consecutive runs of the same code, so
each row also times a reference the way docs/facts.md's figure was taken (best of repeated
runs), before and after the row: the columnar plan encode at 256 sequences, 24 us on the
machine docs/facts.md describes. "x ref" is the mean of the two over 24 us (how much slower
this machine is right now), and "@ref" is TOTAL divided by it: the figure scaled to that
machine.

Comparing two versions: alternating whole runs is not enough here (a machine phase
can fake a 20 % gain). ``--against REV`` loads the scheduler package of git revision
REV beside the working tree's and runs both on the same workload in lockstep, steps
interleaved (order alternating), so both see the same phases; it prints each one's
per-phase p50 and the median of the per-step time ratios (new / REV).

    make bench-scheduler      # or: .venv/bin/python -m benchmarks.bench_scheduler
    .venv/bin/python -m benchmarks.bench_scheduler --against HEAD~3 --sizes 256 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import pathlib
import timeit

from benchmarks import nano_vllm_ref, scheduler_compare
from benchmarks.scheduler_steps import (
    BLOCK_SIZE,
    PACER,
    WARMUP,
    Stepper,
)
from protos.continuum.v1 import executor_pb2 as pb
from sim.workload import default_trace, load_trace

REFERENCE_US = 24.0  # docs/facts.md: protobuf, columnar, encode at 256 sequences


def reference_encode() -> bytes:
    """docs/facts.md's "protobuf, columnar" encode: 256 decodes, 1 in 16 adding a block."""
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


# Timed steps per size (after WARMUP). 1,024 gets as many as 256: at 100 its lockstep
# ratio swung 0.96-1.11 between runs of the same two revisions (the p50s within 2 %), at
# 300 it stays within 0.97-1.02.
STEPS = {64: 400, 256: 300, 1024: 300}


def load_trace_lengths() -> list[tuple[int, int]]:
    """(prompt, output) token counts of the Azure conversation trace (../shared/data)."""
    path = default_trace()
    if not path.exists():
        raise SystemExit(f"--lengths trace: {path} not found (set CONTINUUM_DATA_DIR)")
    return [(r.num_prompt_tokens, r.num_output_tokens) for r in load_trace(path)]


def bench(num_seqs: int, steps: int, kv_fraction: float = 0.85, decode_only: bool = False,
          trace: list[tuple[int, int]] | None = None) -> dict[str, float]:
    stepper = Stepper(num_seqs, kv_fraction, decode_only=decode_only, trace=trace)
    for _ in range(WARMUP):
        stepper.step(record=False)
    while decode_only and stepper.last_prefill_tokens:  # until every prompt is in
        stepper.step(record=False)
    for _ in range(steps):
        stepper.step(record=True)
    return stepper.summary()


def reference_us() -> float:
    """Best of 5 × 200 reference encodes, in µs each."""
    return min(timeit.repeat(reference_encode, number=200, repeat=5)) / 200 * 1e6


def _row(n: int, kv: str, r: dict[str, float]) -> str:
    return (f"{n:>5} {kv:>11} {r['running']:>7} {r['tokens_per_step']:>8.0f} "
            f"{r['schedule']:>9.0f} {r['plan']:>6.0f} {r['serialize']:>9.0f} "
            f"{r['update']:>7.0f} {r['total']:>9.0f} {r['mean_total']:>6.0f} "
            f"{r['p99']:>5.0f} {r['max']:>6.0f} "
            f"{r['executor_parse']:>10.0f} {r['preemptions']:>7} {r['hit_rate']:>10.0%}")


HEADER = (f"{'seqs':>5} {'kv':>11} {'running':>7} {'tok/step':>8} {'schedule':>9} "
          f"{'plan':>6} {'serialize':>9} {'update':>7} {'TOTAL p50':>9} {'mean':>6} {'p99':>5} "
          f"{'max':>6} "
          f"{'exec parse':>10} {'preempt':>7} {'prefix hits':>11}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_scheduler",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256,1024",
                        help="running sequences per row, comma-separated")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="git revision to compare with, in lockstep")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size")
    parser.add_argument("--lengths", choices=("synthetic", "trace"), default="synthetic",
                        help="length mix: synthetic, or the Azure conversation trace's")
    parser.add_argument("--nano-vllm", metavar="DIR", type=pathlib.Path,
                        default=os.environ.get("NANO_VLLM_DIR") or None,
                        help="a nano-vllm checkout: also time its decode-only step beside "
                             "ours, interleaved, and print the two ratios (default: "
                             "$NANO_VLLM_DIR)")
    parser.add_argument("--block-sizes", default=str(BLOCK_SIZE),
                        help="with --nano-vllm: KV block sizes to compare at, both "
                             f"schedulers alike, comma-separated (default {BLOCK_SIZE}, the "
                             f"executor's; {nano_vllm_ref.NATIVE_BLOCK_SIZE} is nano-vllm's own)")
    parser.add_argument("--gc", choices=("paced", "auto"), default="paced",
                        help="garbage collection: paced between steps, as the scheduler "
                             "process runs it (scheduler_svc/gc_pacing.py), or the "
                             "interpreter's automatic collection inside them")
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
        block_sizes = [int(x) for x in args.block_sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes and --block-sizes must be comma-separated integers, got "
                     f"{args.sizes!r} and {args.block_sizes!r}")
    if any(n < 1 for n in sizes + block_sizes) or args.repeats < 1:
        parser.error("--sizes, --block-sizes and --repeats must be positive")
    steps = {n: STEPS.get(n, 200) for n in sizes}
    if args.gc == "paced":
        PACER.take_over()
    trace = load_trace_lengths() if args.lengths == "trace" else None
    if args.against:
        scheduler_compare.print_lockstep(args.against, sizes, steps, args.repeats, trace)
        return
    if args.nano_vllm:
        scheduler_compare.print_against_nano(pathlib.Path(args.nano_vllm), sizes, steps,
                                             args.repeats, trace, block_sizes)
        return
    print(f"lengths: {args.lengths}")
    print(HEADER + f" {'x ref':>6} {'@ref':>5}   (µs per step)")
    rows = [(n, 0.85) for n in sizes] + ([(256, 0.65)] if 256 in sizes else [])
    for n, kv in rows:
        for _ in range(args.repeats):
            before = reference_us()
            r = bench(n, steps[n], kv, trace=trace)
            speed = (before + reference_us()) / 2 / REFERENCE_US
            print(_row(n, f"{kv:.0%}", r) + f" {speed:>6.2f} {r['total'] / speed:>5.0f}")
    for n in sizes:
        for _ in range(args.repeats):
            before = reference_us()
            r = bench(n, steps[n], decode_only=True, trace=trace)
            speed = (before + reference_us()) / 2 / REFERENCE_US
            print(_row(n, "decode-only", r) + f" {speed:>6.2f} {r['total'] / speed:>5.0f}")


if __name__ == "__main__":
    main()

"""Cost of the scheduler's per-step control path, without any model (docs/benchmarks.md §3).

N running sequences on a mix that shares a 64-token system prompt (prefix cache), with
16–400-token own prompts (chunked prefill) and 8–200 output tokens, in a pool of 85 % of
what the running set needs (65 %: the "tight" rows, which preempt), and decode-only (N
sequences that only decode: the floor of the same path). Per step: schedule(), the plan
frame's encoding, update(), and the executor's parse apart. "x ref" is this machine's speed
against docs/facts.md's reference encode, timed before and after each row; "@ref" is TOTAL
scaled by it. Garbage is collected between steps as the scheduler process does
(``--gc auto``: inside them).

``--against REV`` runs git revision REV's scheduler package beside the working tree's on
the same workload, steps interleaved, and prints each one's per-phase p50 and the median
per-step ratio; ``--nano-vllm DIR`` times nano-vllm's decode-only step beside ours
(benchmarks/nano_vllm_ref.py).

    make bench-scheduler      # or: .venv/bin/python -m benchmarks.bench_scheduler
    .venv/bin/python -m benchmarks.bench_scheduler --against HEAD~3 --sizes 256 --repeats 3
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import io
import itertools
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import timeit
import types

from benchmarks import nano_vllm_ref
from benchmarks.scheduler_steps import (
    BLOCK_SIZE,
    PACER,
    WARMUP,
    Stepper,
    Workload,
    scheduler_api,
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


def load_revision(rev: str) -> types.SimpleNamespace:
    """The scheduler package of git revision ``rev``, imported beside the working tree's
    under another name (its files copied to a temporary directory, the package name in
    its imports rewritten)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run(["git", "archive", rev, "scheduler_svc"], cwd=root,
                          capture_output=True, check=False)
    if done.returncode:
        raise SystemExit(f"--against {rev}: git archive failed: "
                         f"{done.stderr.decode().strip()}")
    name = "scheduler_svc_" + re.sub(r"\W", "_", rev)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="continuum-ab-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(tmp, filter="data")
    (tmp / "scheduler_svc").rename(tmp / name)
    for path in (tmp / name).rglob("*.py"):
        path.write_text(re.sub(r"\bscheduler_svc\b", name, path.read_text()))
    sys.path.insert(0, str(tmp))
    core = importlib.import_module(f"{name}.core")
    plan = importlib.import_module(f"{name}.plan")
    return scheduler_api(core, plan)


def lockstep(num_seqs: int, steps: int, kv_fraction: float, other,
             trace: list[tuple[int, int]] | None = None,
             decode_only: bool = False) -> dict[str, float]:
    """``other``'s scheduler and the working tree's on the same workload (the mix with a
    ``kv_fraction`` pool, or with ``decode_only`` every step all decodes once the prompts
    are in), steps interleaved (which goes first alternates). Per-phase p50s of both, and
    the median of the per-step ratios working tree / other."""
    theirs = Stepper(num_seqs, kv_fraction, api=other, trace=trace, decode_only=decode_only)
    ours = Stepper(num_seqs, kv_fraction, trace=trace, decode_only=decode_only)
    for stepper in (theirs, ours) if decode_only else ():
        while stepper.last_prefill_tokens or not stepper.sched.running:
            stepper.step(record=False)
    ratios = []
    for i in range(steps + WARMUP):
        record = i >= WARMUP
        if i % 2:
            a = theirs.step(record)
            b = ours.step(record)
        else:
            b = ours.step(record)
            a = theirs.step(record)
        if record:
            ratios.append(b / a)
    return {"theirs": theirs.summary(), "ours": ours.summary(),
            "ratio": statistics.median(ratios)}


def against_nano_vllm(num_seqs: int, steps: int, nano,
                      trace: list[tuple[int, int]] | None = None,
                      block_size: int = BLOCK_SIZE) -> dict[str, float]:
    """Ours on the mix (85 % pool) and decode-only, and nano-vllm's decode-only step
    (benchmarks/nano_vllm_ref.py), all with ``block_size``-token blocks, interleaved:
    each one's p50 in µs."""
    mix = Stepper(num_seqs, 0.85, trace=trace, block_size=block_size)
    decode = Stepper(num_seqs, decode_only=True, trace=trace, block_size=block_size)
    while decode.last_prefill_tokens or not decode.sched.running:
        decode.step(record=False)
    work = Workload(trace=trace)
    lens = [len(work.request().token_ids) for _ in range(num_seqs)]
    theirs = nano_vllm_ref.DecodeOnly(nano, num_seqs, lens, steps + WARMUP, block_size)
    p50s = nano_vllm_ref.interleaved_p50s((mix.step, decode.step, lambda _: theirs.step()),
                                          steps, WARMUP)
    return dict(zip(("mix", "decode", "nano"), p50s, strict=True))


def print_lockstep(rev: str, sizes: list[int], steps: dict[int, int], repeats: int,
                    trace) -> None:
    other = load_revision(rev)
    print(f"lockstep: working tree vs {rev} (µs per step, p50)")
    for workload, decode_only in (("mix", False), ("decode-only", True)):
        for n in sizes:
            for _ in range(repeats):
                r = lockstep(n, steps[n], 0.85, other, trace, decode_only)
                for who, label in (("theirs", rev), ("ours", "working tree")):
                    x = r[who]
                    print(f"{workload:>11} {n:>5} {label:>14}: schedule "
                          f"{x['schedule']:>6.0f}  plan {x['plan']:>5.0f}  serialize "
                          f"{x['serialize']:>4.0f}  update {x['update']:>5.0f}  TOTAL "
                          f"{x['total']:>6.0f}")
                print(f"{workload:>11} {n:>5} per-step ratio working tree / {rev}: "
                      f"{r['ratio']:.3f}")


def print_against_nano(checkout: pathlib.Path, sizes: list[int], steps: dict[int, int],
                        repeats: int, trace, block_sizes: list[int]) -> None:
    nano = nano_vllm_ref.load(checkout)
    print("against nano-vllm's decode-only step, interleaved, both with the same block "
          "size (µs per step, p50)")
    for bs, n in itertools.product(block_sizes, sizes):
        for _ in range(repeats):
            r = against_nano_vllm(n, steps[n], nano, trace, bs)
            print(f"{n:>5} bs {bs:>3}  ours mix {r['mix']:>6.0f}  ours decode-only "
                  f"{r['decode']:>5.0f}  "
                  f"nano-vllm decode-only {r['nano']:>5.0f}  |  decode-only / nano "
                  f"{r['decode'] / r['nano']:.2f} (target <= 0.5)  mix / nano decode-only "
                  f"{r['mix'] / r['nano']:.2f} (target <= 1)")


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
        print_lockstep(args.against, sizes, steps, args.repeats, trace)
        return
    if args.nano_vllm:
        print_against_nano(pathlib.Path(args.nano_vllm), sizes, steps, args.repeats, trace,
                           block_sizes)
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

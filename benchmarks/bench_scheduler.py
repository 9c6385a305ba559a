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
The "decode-only" row is the floor of the same path: N sequences that only decode
(no admission, finish or prefill), i.e. what the columnar per-decode work costs.

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
import atexit
import dataclasses
import importlib
import io
import itertools
import os
import pathlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import timeit
import types

import scheduler_svc.core
import scheduler_svc.plan
from benchmarks import nano_vllm_ref
from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import Request
from scheduler_svc.core.config import QUEUE_TIME_FIELDS
from sim.workload import default_trace, load_trace

SYSTEM_PROMPT = list(range(1000, 1064))
BLOCK_SIZE = 16  # the executor's default (--block-size)
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


PHASES = ("schedule", "plan", "serialize", "update", "executor_parse")
STEPS = {64: 400, 256: 300, 1024: 100}  # timed steps per size (after WARMUP)
WARMUP = 50


def scheduler_api(core, plan) -> types.SimpleNamespace:
    """What the benchmark uses of a scheduler package (its ``core`` and ``plan``
    modules): one plan builder's ``prepare`` and ``message`` where ``plan`` has a
    PlanBuilder (it owns the prompts' wire form), else its module functions
    (revisions before ``plan.prepare`` lack that one)."""
    builder = plan.PlanBuilder() if hasattr(plan, "PlanBuilder") else None
    return types.SimpleNamespace(
        Request=core.Request, Scheduler=core.Scheduler, SchedulerConfig=core.SchedulerConfig,
        ModelInfo=core.ModelInfo, QueueFull=core.QueueFull,
        build_plan_message=plan.build_plan_message if builder is None else builder.message,
        prepare=getattr(plan, "prepare", None) if builder is None else builder.prepare)


def current_api() -> types.SimpleNamespace:
    """The working tree's scheduler."""
    return scheduler_api(scheduler_svc.core, scheduler_svc.plan)


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


def load_trace_lengths() -> list[tuple[int, int]]:
    """(prompt, output) token counts of the Azure conversation trace (../shared/data)."""
    path = default_trace()
    if not path.exists():
        raise SystemExit(f"--lengths trace: {path} not found (set CONTINUUM_DATA_DIR)")
    return [(r.num_prompt_tokens, r.num_output_tokens) for r in load_trace(path)]


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
        plan = self.api.build_plan_message(out, "inc", sched.block_manager)
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
        self.last_prefill_tokens = out.num_prefill_tokens
        if record:
            if not self.timings["schedule"]:
                self.preempts_at_start = sched.num_preemptions
            for key, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t6 - t5, t4 - t3),
                               strict=True):
                self.timings[key].append(dt * 1e6)
            self.tokens += out.num_batched_tokens
        return (t3 - t0 + t6 - t5) * 1e6

    def summary(self) -> dict[str, float]:
        timings, sched = self.timings, self.sched
        bm = sched.block_manager
        steps = len(timings["schedule"])
        med = {k: statistics.median(v) for k, v in timings.items()}
        med["total"] = med["schedule"] + med["plan"] + med["serialize"] + med["update"]
        med["mean_total"] = sum(statistics.mean(timings[k])
                                for k in ("schedule", "plan", "serialize", "update"))
        med["running"] = len(sched.running)
        med["tokens_per_step"] = self.tokens / steps
        med["preemptions"] = sched.num_preemptions - self.preempts_at_start
        med["hit_rate"] = bm.num_cache_hits / max(1, bm.num_cache_queries)
        return med


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


def lockstep(num_seqs: int, steps: int, kv_fraction: float, other,
             trace: list[tuple[int, int]] | None = None) -> dict[str, float]:
    """``other``'s scheduler and the working tree's on the same workload, steps
    interleaved (which goes first alternates). Per-phase p50s of both, and the median of
    the per-step ratios working tree / other."""
    theirs = Stepper(num_seqs, kv_fraction, api=other, trace=trace)
    ours = Stepper(num_seqs, kv_fraction, trace=trace)
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


def reference_us() -> float:
    """Best of 5 × 200 reference encodes, in µs each."""
    return min(timeit.repeat(reference_encode, number=200, repeat=5)) / 200 * 1e6


def _row(n: int, kv: str, r: dict[str, float]) -> str:
    return (f"{n:>5} {kv:>11} {r['running']:>7} {r['tokens_per_step']:>8.0f} "
            f"{r['schedule']:>9.0f} {r['plan']:>6.0f} {r['serialize']:>9.0f} "
            f"{r['update']:>7.0f} {r['total']:>9.0f} {r['mean_total']:>6.0f} "
            f"{r['executor_parse']:>10.0f} {r['preemptions']:>7} {r['hit_rate']:>10.0%}")


HEADER = (f"{'seqs':>5} {'kv':>11} {'running':>7} {'tok/step':>8} {'schedule':>9} "
          f"{'plan':>6} {'serialize':>9} {'update':>7} {'TOTAL p50':>9} {'mean':>6} "
          f"{'exec parse':>10} {'preempt':>7} {'prefix hits':>11}")


def _print_lockstep(rev: str, sizes: list[int], steps: dict[int, int], repeats: int,
                    trace) -> None:
    other = load_revision(rev)
    print(f"lockstep: working tree vs {rev} (µs per step, p50)")
    for n in sizes:
        for _ in range(repeats):
            r = lockstep(n, steps[n], 0.85, other, trace)
            for who, label in (("theirs", rev), ("ours", "working tree")):
                x = r[who]
                print(f"{n:>5} {label:>14}: schedule {x['schedule']:>6.0f}  plan "
                      f"{x['plan']:>5.0f}  serialize {x['serialize']:>4.0f}  update "
                      f"{x['update']:>5.0f}  TOTAL {x['total']:>6.0f}")
            print(f"{n:>5} per-step ratio working tree / {rev}: {r['ratio']:.3f}")


def _print_against_nano(checkout: pathlib.Path, sizes: list[int], steps: dict[int, int],
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
    trace = load_trace_lengths() if args.lengths == "trace" else None
    if args.against:
        _print_lockstep(args.against, sizes, steps, args.repeats, trace)
        return
    if args.nano_vllm:
        _print_against_nano(pathlib.Path(args.nano_vllm), sizes, steps, args.repeats, trace,
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

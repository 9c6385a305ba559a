"""bench_scheduler's comparisons: the working tree against a committed revision in
lockstep (``--against REV``) and against nano-vllm's scheduler (``--nano-vllm DIR``),
each with the steps interleaved so that both sides see the same machine phases."""

from __future__ import annotations

import atexit
import importlib
import io
import itertools
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import types

from benchmarks import nano_vllm_ref
from benchmarks.scheduler_steps import BLOCK_SIZE, WARMUP, Stepper, Workload, scheduler_api


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

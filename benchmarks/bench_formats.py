"""Weight formats A/B in one run (executor_svc/weight_formats.py): decode steps at batch 1
and 64 and one 512-token prefill per format, rounds alternating between the formats; each
step against the roofline of the bytes that format streams over the best read bandwidth.
``make bench-executor`` runs it after its own table.

    .venv/bin/python -m benchmarks.bench_formats [--formats native,fp32] [--batches 1,64]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from benchmarks.bench_decode import (
    DecodeRun,
    add_point_args,
    clock_of,
    load,
    ours_prefill_tokens_per_s,
    read_gbs,
    weight_bytes,
)
from executor_svc.model_files import resolve_model
from executor_svc.models import decoder
from executor_svc.models.decoder import DecoderModel
from executor_svc.settings import Switches
from kernels import make_backend


def format_ab(path, switches: Switches, formats: list[str], batches: list[int], context: int,
              rounds: int, steps: int, clock=time.perf_counter, warmup: int = 2) -> None:
    """Prints the A/B table: per format and batch the median over rounds of each round's
    median step, bytes per step, GB/s achieved and the share of the memory roofline."""
    options = {**decoder.model_options(switches)}
    models = {}
    for fmt in formats:
        start = time.perf_counter()
        models[fmt] = DecoderModel.load(path, **{**options, "weight_format": fmt})
        print(f"  {fmt}: loaded in {time.perf_counter() - start:.1f} s as "
              f"{models[fmt].weight_format}, {weight_bytes(models[fmt]) / 1e6:.0f} MB of "
              f"weights per step", flush=True)
    backend = make_backend(None, native_options=decoder.native_options(switches))
    c = next(iter(models.values())).config
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    times: dict[tuple[str, int], list[float]] = {(f, b): [] for f in formats for b in batches}
    prefill: dict[str, list[float]] = {f: [] for f in formats}
    bandwidth: list[float] = []
    for r in range(rounds):
        bandwidth.append(read_gbs(clock, repeats=5))
        order = formats if r % 2 == 0 else formats[::-1]  # ABBA: drift hits both alike
        for fmt in order:
            for batch in batches:
                run = DecodeRun(models[fmt], backend, batch, context, steps + warmup, clock)
                times[fmt, batch].append(run.timed(warmup, steps))
                del run
            prefill[fmt].append(ours_prefill_tokens_per_s(models[fmt], backend, 512, clock))
            gc.collect()
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{f} b{b} {statistics.median(times[f, b][-1:]) * 1e3:.1f} ms" for f in formats
            for b in batches) + f"; read {bandwidth[-1]:.1f} GB/s; {load()}", flush=True)
    gbs = max(bandwidth)
    print(f"\nweight formats, A/B over {rounds} alternating rounds (median of per-round "
          f"medians of {steps} steps), context {context}, {torch.get_num_threads()} threads; "
          f"roofline: bytes/step over the best measured read bandwidth, {gbs:.1f} GB/s")
    print("| format | batch | weights MB/step | KV MB/step | ms/step | tok/s | GB/s achieved "
          "| roofline ms | of roofline |")
    for fmt in formats:
        for batch in batches:
            weights = weight_bytes(models[fmt], batch)
            seconds = statistics.median(times[fmt, batch])
            total = weights + kv_per_token * context * batch
            bound = total / (gbs * 1e9)
            print(f"| {fmt} | {batch} | {weights / 1e6:.0f} | "
                  f"{kv_per_token * context * batch / 1e6:.0f} | {seconds * 1e3:.1f} | "
                  f"{batch / seconds:.0f} | {total / seconds / 1e9:.1f} | {bound * 1e3:.1f} | "
                  f"{bound / seconds:.0%} |")
    print("prefill, one 512-token prompt (tokens/s, median): " + ", ".join(
        f"{f} {statistics.median(v):.0f}" for f, v in prefill.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", type=lambda s: s.split(","), default=["native", "hybrid", "fp32"])
    p.add_argument("--rounds", type=int, default=4)
    add_point_args(p, batches=[1, 64], steps=6)
    args = p.parse_args()
    clock = clock_of(args)
    switches = Switches.from_env()
    format_ab(resolve_model(None, switches.cache_dir), switches, args.formats, args.batches,
              args.context, args.rounds, args.steps, clock, args.warmup)


if __name__ == "__main__":
    main()

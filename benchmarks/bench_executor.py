"""Executor decode and prefill speed on the bundled model, against transformers and the roofline.

In one process, on the same cores: (1) the machine's fp32 matmul GFLOP/s and streaming read
bandwidth, (2) our Runner executing real BatchPlans (plan check, batch building, forward,
sampling) for ``B`` sequences decoding at ``--context`` tokens, (3) transformers'
``generate()`` decoding the same batch (static batch, fp32, greedy) from a cache already
holding the context, (4) one 512-token prefill each, (5) where our step time goes at the
breakdown batch. The KV of the context is not computed (it does not change the cost of a
step), so a point takes seconds instead of a batch-sized prefill.

    make bench-executor      # or: .venv/bin/python -m benchmarks.bench_executor [--no-hf]
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from benchmarks.bench_breakdown import breakdown
from benchmarks.bench_decode import DecodeRun, ours_prefill_tokens_per_s
from benchmarks.bench_formats import format_ab, weight_bytes
from benchmarks.hf_baseline import best_seconds, hf_decode_seconds, hf_prefill_tokens_per_s
from executor_svc.model_files import resolve_model
from executor_svc.models import decoder
from executor_svc.models.decoder import DecoderModel
from executor_svc.models.ops import project
from executor_svc.settings import Switches
from kernels import BACKEND_NAMES, DEFAULT_BACKEND, make_backend, native


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def machine_ceilings(hidden: int, inter: int, clock, native_options=None) -> dict[str, float]:
    """fp32 GFLOP/s of a layer's matmul shape at 64 and 512 tokens, through MKL (``project``
    on a plain tensor) and through the native GEMM (a packed weight) where it builds; the
    compute ceiling is the best of them. Read GB/s (sum)."""
    w = torch.randn(inter, hidden)
    lib = native.load(native_options)
    weights = {"mkl": w, **({"native": lib.pack_weight(w)} if lib is not None else {})}
    out = {}
    for name, weight in weights.items():
        for rows in (64, 512):
            x = torch.randn(hidden, rows)
            seconds = best_seconds(lambda x=x, weight=weight: project(weight, x), clock,
                                   repeats=20)
            out[f"gflops_{name}_{rows}"] = 2 * rows * hidden * inter / seconds / 1e9
    out["gflops_peak"] = max(out.values())
    big = torch.ones(64 << 20)  # 256 MiB
    out["read_gbs"] = big.numel() * 4 / best_seconds(big.sum, clock, repeats=10) / 1e9
    return out


def print_fma_peak(native_options, best_gflops: float) -> None:
    """The FMA issue peak (what no GEMM can pass: FMAs with every operand in a register)
    and the best measured matmul's share of it; nothing without the native kernels."""
    lib = native.load(native_options)
    if lib is None:
        return
    threads = torch.get_num_threads()
    peak = lib.fma_peak_gflops(threads)
    print(f"FMA issue peak, {threads} threads: {peak:.0f} GFLOP/s (1 thread: "
          f"{lib.fma_peak_gflops(1):.0f}); the best matmul above is {best_gflops / peak:.0%} "
          "of it", flush=True)


def model_flops_per_token(model: DecoderModel, context: int) -> float:
    c = model.config
    weights = sum(t.numel() for layer in model.layers for t in (layer.wqkv, layer.wo,
                                                                layer.w13, layer.w2))
    attention = 4 * c.num_heads * c.head_dim * context * c.num_layers  # QK^T and PV
    return 2 * (weights + model.lm_head.numel()) + attention


def step_bytes(model: DecoderModel, batch: int, context: int, kv_bytes: int = 4) -> float:
    """Weights as the model's weight format stores them (bench_formats.weight_bytes; tied
    embedding counted once) + every KV (``kv_bytes`` per element: 2 with --kv-cache-dtype
    float16 / bfloat16)."""
    c = model.config
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * context * batch
    return weight_bytes(model, batch) + kv_bytes * kv


def ours(model, backends: dict, args, clock, headline: str,
         ceilings: dict[int, dict[str, float]]) -> dict[tuple[str, int], float]:
    """Seconds per decode step, per (backend, batch). The machine's ceilings are measured
    again just before and just after each headline point; ``ceilings[batch]`` gets the best
    of the two (the point's own roofline: this machine's speed moves by +-25 % from one
    minute to the next, so a ceiling from the start of the run can belong to another
    minute than the step it divides)."""
    c, out, native_options = model.config, {}, decoder.native_options(args.switches)
    for batch in args.batches:
        for name, backend in backends.items():
            run = DecodeRun(model, backend, batch, args.context, args.warmup + args.steps, clock,
                            KV_DTYPES[args.kv_cache_dtype], native_options)
            if name == headline:
                before = machine_ceilings(c.hidden_size, c.intermediate_size, clock,
                                          native_options)
            out[name, batch] = run.timed(args.warmup, args.steps)
            if name == headline:
                after = machine_ceilings(c.hidden_size, c.intermediate_size, clock,
                                         native_options)
                ceilings[batch] = {k: max(before[k], after[k]) for k in before}
            print(f"  ours[{name}] batch {batch}: {out[name, batch] * 1e3:.1f} ms/step  "
                  f"({load()})", flush=True)
            del run
            gc.collect()
    return out


KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPES), default="float32",
                   help="our KV pool's element type (transformers keeps float32)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 8, 32, 64, 128])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per point")
    p.add_argument("--backends", type=lambda s: s.split(","), default=[DEFAULT_BACKEND, "torch"],
                   help=f"attention backends to time, first is the headline ({BACKEND_NAMES})")
    p.add_argument("--breakdown-batch", type=int, default=64)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--formats", type=lambda s: [f for f in s.split(",") if f],
                   default=["native", "hybrid", "fp32"],
                   help="weight formats to A/B at batch 1 and 64 at the end ('' to skip)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch (and numba) threads; default torch's (one per core)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this process's CPU time, not wall time: robust on a busy "
                        "shared machine with --threads 1 (with more threads it counts spinning)")
    args = p.parse_args()
    args.switches = Switches.from_env()  # CONTINUUM_NATIVE_* etc., as the executor reads them
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.manual_seed(0)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
                                                     "NUMBA_THREADING_LAYER") if k in os.environ)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'CPU' if args.cpu_time else 'wall'} time, {env or 'default OpenMP env'}, {load()}",
          flush=True)
    path = resolve_model(None, args.switches.cache_dir)
    model = DecoderModel.load(path, **decoder.model_options(args.switches))
    c, native_options = model.config, decoder.native_options(args.switches)
    ceil = machine_ceilings(c.hidden_size, c.intermediate_size, clock, native_options)
    rates = ", ".join(f"{k.removeprefix('gflops_').replace('_', ' at ')} rows {v:.0f}"
                      for k, v in ceil.items() if k.startswith("gflops_") and k != "gflops_peak")
    print(f"matmul fp32 {c.intermediate_size}x{c.hidden_size} @ {c.hidden_size}xrows, GFLOP/s:"
          f" {rates}; read bandwidth {ceil['read_gbs']:.1f} GB/s ({load()})", flush=True)
    print_fma_peak(native_options, ceil["gflops_peak"])
    backends = {}
    for name in args.backends:
        start = time.perf_counter()
        backends[name] = make_backend(name, native_options=native_options)
        print(f"backend {name}: ready in {time.perf_counter() - start:.2f} s", flush=True)
    headline = args.backends[0]
    prefill = {"ours": ours_prefill_tokens_per_s(model, backends[headline], 512, clock,
                                                 native_options)}
    point_ceilings: dict[int, dict[str, float]] = {}
    step_s = ours(model, backends, args, clock, headline, point_ceilings)

    hf_s = {}
    if not args.no_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        hf.eval()
        prefill["transformers"] = hf_prefill_tokens_per_s(hf, 512, clock)
        for batch in args.batches:
            hf_s[batch] = hf_decode_seconds(hf, batch, args.context, args.warmup, args.steps,
                                            clock)
            print(f"  transformers batch {batch}: {hf_s[batch] * 1e3:.1f} ms/step ({load()})",
                  flush=True)
            gc.collect()
        del hf

    report(model, ceil, point_ceilings, args, step_s, hf_s, headline)
    print("\nprefill, one 512-token prompt (tokens/s): "
          + ", ".join(f"{k} {v:.0f}" for k, v in prefill.items()))
    if args.breakdown_batch:
        run = DecodeRun(model, backends[headline], args.breakdown_batch, args.context,
                        args.warmup + args.steps, clock, KV_DTYPES[args.kv_cache_dtype],
                        native_options)
        run.timed(args.warmup, 1)
        ms = breakdown(run, model, args.steps)
        print(f"\nwhere a batch-{args.breakdown_batch} step goes ({headline}; ms/step, "
              f"{load()}):")
        for key, value in sorted(ms.items(), key=lambda kv: -kv[1]):
            print(f"  {key:<24} {value:8.1f}  {value / ms['total']:6.1%}")
    if args.formats:
        del model
        gc.collect()
        format_ab(path, args.switches, args.formats, [1, 64], args.context, 4, args.steps, clock)


def report(model, ceil, point_ceilings, args, step_s, hf_s, headline: str) -> None:
    """The table: "of bound" divides each point's bound (its own ceilings, measured around
    it) by its step time; "at start" divides the bound from the run-start ceilings."""
    flops = model_flops_per_token(model, args.context)
    kv_bytes = torch.empty((), dtype=KV_DTYPES[args.kv_cache_dtype]).element_size()

    def bound_ms(batch: int, c: dict[str, float]) -> tuple[float, float]:
        compute = batch * flops / (c["gflops_peak"] * 1e9) * 1e3
        memory = step_bytes(model, batch, args.context, kv_bytes) / (c["read_gbs"] * 1e9)
        return compute, memory * 1e3

    print(f"\nweight format {model.weight_format}: {weight_bytes(model) / 1e6:.0f} MB/step")
    print(f"\ncontext {args.context}, {args.steps} timed steps after {args.warmup}; roofline: "
          f"max({flops / 1e6:.0f} MFLOP/token / GFLOP/s, bytes / GB/s), each point's ceilings "
          f"the best of those measured just before and after it ({load()})")
    others = [name for name, _ in step_s if name != headline]
    cols = "".join(f" {name + ' ms':>10}" for name in dict.fromkeys(others))
    print(f"| batch | ours ms/step | ours tok/s |{cols} | HF ms/step | HF tok/s | vs HF "
          f"| GFLOP/s · GB/s | bound ms (flop/mem) | bound tok/s | of bound | at start |")
    for batch in args.batches:
        ms = step_s[headline, batch] * 1e3
        c = point_ceilings[batch]
        compute, memory = bound_ms(batch, c)
        bound = max(compute, memory)
        at_start = max(bound_ms(batch, ceil))
        extra = "".join(f" {step_s[name, batch] * 1e3:>10.1f}" for name in dict.fromkeys(others))
        hf_ms = hf_s.get(batch, float("nan")) * 1e3
        print(f"| {batch} | {ms:.1f} | {batch / ms * 1e3:.0f} |{extra} | {hf_ms:.1f} "
              f"| {batch / hf_ms * 1e3:.0f} | {hf_ms / ms:.2f}x "
              f"| {c['gflops_peak']:.0f} · {c['read_gbs']:.1f} | {bound:.0f} ({compute:.0f}/"
              f"{memory:.0f}) | {batch / bound * 1e3:.0f} | {bound / ms:.0%} "
              f"| {at_start / ms:.0%} |")


if __name__ == "__main__":
    main()

"""Executor decode and prefill speed on the bundled model, against transformers and the roofline.

In one process, on the same cores: the machine's fp32 matmul GFLOP/s and read bandwidth;
our Runner executing real BatchPlans for ``B`` sequences decoding at ``--context`` tokens;
transformers' ``generate()`` decoding the same batch (static, fp32, greedy) from a cache
already holding the context (zeros: the KV of the context is not computed, it does not
change a step's cost); one 512-token prefill each; where our step time goes at the
breakdown batch; then the weight formats A/B (benchmarks/bench_formats.py).

    make bench-executor      # or: .venv/bin/python -m benchmarks.bench_executor [--no-hf]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

import executor_svc.models.decoder as model_mod  # the names its forward looks up
import executor_svc.runner as runner_mod
from benchmarks.bench_decode import (
    DecodeRun,
    add_point_args,
    best_seconds,
    clock_of,
    load,
    ours_prefill_tokens_per_s,
    read_gbs,
    weight_bytes,
)
from benchmarks.bench_formats import format_ab
from executor_svc.model_files import resolve_model
from executor_svc.models import decoder
from executor_svc.models.decoder import DecoderModel
from executor_svc.models.ops import project
from executor_svc.settings import Switches
from kernels import BACKEND_NAMES, DEFAULT_BACKEND, make_backend, native, quant
from kernels.native_decoder import NativeDecoder


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
    out["read_gbs"] = read_gbs(clock)
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
    """Weights as the model's weight format stores them (bench_decode.weight_bytes; tied
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
    add_point_args(p, batches=[1, 8, 32, 64, 128], steps=8)
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPES), default="float32",
                   help="our KV pool's element type (transformers keeps float32)")
    p.add_argument("--backends", type=lambda s: s.split(","), default=[DEFAULT_BACKEND, "torch"],
                   help=f"attention backends to time, first is the headline ({BACKEND_NAMES})")
    p.add_argument("--breakdown-batch", type=int, default=64)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--formats", type=lambda s: [f for f in s.split(",") if f],
                   default=["native", "hybrid", "fp32"],
                   help="weight formats to A/B at batch 1 and 64 at the end ('' to skip)")
    args = p.parse_args()
    args.switches = Switches.from_env()  # CONTINUUM_NATIVE_* etc., as the executor reads them
    return args


def main() -> None:
    args = parse_args()
    clock = clock_of(args)
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
        format_ab(path, args.switches, args.formats, [1, 64], args.context, 4, args.steps, clock,
                  args.warmup)


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


class Breakdown:
    """Wall time per component, by wrapping the functions a step calls (instrumentation
    only: the bench restores every wrapped attribute)."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner, attr: str, name_of) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name_of(*args)] += self.clock() - start

        self._undo.append((owner, attr, original))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)


def breakdown(run: DecodeRun, model: DecoderModel, steps: int) -> dict[str, float]:
    """ms per step: plan check + apply, batch building, layer matmuls, LM head, attention,
    KV write, norms/rope/other forward ops, sampling, the rest of Runner.execute. A
    step's layers run in one native call (kernels/cpu_decoder.cpp): its phases
    come from the decoder's own clock, the rest from wrapped Python functions."""
    b, r = Breakdown(run.clock), run.runner
    decoder = model._decoder
    phases = np.zeros(len(NativeDecoder.PHASES)) if decoder is not None else None
    if decoder is not None:
        decoder.phase_seconds = phases
    head = model.lm_head
    b.wrap(runner_mod, "check_plan", lambda *a: "plan check + apply")
    b.wrap(r, "_apply", lambda *a: "plan check + apply")
    b.wrap(runner_mod, "build_inputs", lambda *a: "batch building")
    b.wrap(model_mod, "linear", lambda x, w: "LM head" if w is head else "layer matmuls")
    b.wrap(model_mod, "project", lambda w, x: "layer matmuls")  # tensor or packed weight
    b.wrap(native.PackedWeight, "mm_t", lambda w, x: "LM head")
    b.wrap(quant.QuantWeight, "mm_t", lambda w, x: "LM head")
    b.wrap(r.backend, "forward", lambda *a: "attention")
    b.wrap(r.backend, "prepare", lambda *a: "attention")
    b.wrap(r.kv, "write", lambda *a: "KV write")
    b.wrap(r, "forward", lambda *a: "forward")
    b.wrap(r.sampler, "sample", lambda *a: "sampling")
    total = 0.0
    try:
        for _ in range(steps):
            total += run.step()
    finally:
        b.restore()
        if decoder is not None:
            decoder.phase_seconds = None
    ms = {k: v * 1e3 / steps for k, v in b.seconds.items()}
    for name, seconds in zip(NativeDecoder.PHASES, phases if phases is not None else (),
                             strict=False):
        ms[name] = ms.get(name, 0.0) + seconds * 1e3 / steps
    inner = sum(ms.setdefault(k, 0.0) for k in ("layer matmuls", "LM head", "attention",
                                                 "KV write"))
    inner += sum(ms.get(k, 0.0) for k in ("norms + residual", "rope + q/k/v layout", "SwiGLU"))
    ms["other forward ops"] = ms.pop("forward") - inner
    ms["total"] = total * 1e3 / steps
    ms["rest of execute"] = ms["total"] - ms["other forward ops"] - inner - sum(
        ms[k] for k in ("plan check + apply", "batch building", "sampling"))
    return ms


def hf_decode_seconds(hf, batch: int, context: int, warmup: int, steps: int, clock) -> float:
    """Median seconds per generate() step, timed per token with a streamer, from a
    DynamicCache that already holds ``context`` positions (zeros: the cost is the same)."""
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer

    class Ticks(BaseStreamer):
        def __init__(self) -> None:
            self.ticks: list[float] = []

        def put(self, value) -> None:
            self.ticks.append(clock())

        def end(self) -> None:
            pass

    c = hf.config
    shape = (batch, c.num_key_value_heads, context, c.hidden_size // c.num_attention_heads)
    cache = DynamicCache(config=c)
    for layer in range(c.num_hidden_layers):
        cache.update(torch.zeros(shape), torch.zeros(shape), layer)
    ids = torch.randint(3, c.vocab_size, (batch, context + 1), generator=torch.Generator())
    streamer, n = Ticks(), warmup + steps
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                    max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer)
    intervals = [b - a for a, b in zip(streamer.ticks, streamer.ticks[1:], strict=False)]
    return statistics.median(intervals[warmup:])


def hf_prefill_tokens_per_s(hf, num_tokens: int, clock) -> float:
    ids = torch.randint(3, hf.config.vocab_size, (1, num_tokens), generator=torch.Generator())

    def once():
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                        do_sample=False)

    return num_tokens / best_seconds(once, clock, repeats=2)


if __name__ == "__main__":
    main()

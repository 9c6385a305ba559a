"""The native CPU decode attention (kernels/cpu_attention.cpp) alone, full and windowed.

    python -m benchmarks.bench_attention --batch 16 --context 4096 --windows 0,512

A decode step's attention call for one layer: ``batch`` rows at ``context`` cached
positions each, blocks scattered through a pool (as a long-running server's are), for each
sliding window (0: full attention). Prints the median of ``--reps`` calls per window and
its speedup over full attention; windows are timed round-robin, so a shift in the shared
machine's load hits all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from kernels import native

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def make_step(batch: int, context: int, heads: int, kv_heads: int, dim: int, block: int,
              dtype: torch.dtype, seed: int = 0):
    """(q, k_pool, v_pool, rows, tables, context_lens, out) for one decode step."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block)
    order = torch.randperm(batch * per_seq, generator=gen).numpy()
    tables = np.ascontiguousarray(order.reshape(batch, per_seq).astype(np.int64))
    shape = (batch * per_seq, block, kv_heads, dim)
    k_pool = torch.randn(shape, generator=gen).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(batch, heads, dim, generator=gen).numpy()
    rows = np.arange(batch, dtype=np.int64)
    lens = np.full(batch, context, dtype=np.int64)
    return q, k_pool, v_pool, rows, tables, lens, np.empty_like(q)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--windows", default="0,512", help="comma-separated; 0: full attention")
    p.add_argument("--heads", type=int, default=9, help="query heads (bundled model: 9)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", choices=DTYPES, default="float32")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args(argv)
    lib = native.load()
    if lib is None:
        print("no native kernels here (no g++ / AVX2)", file=sys.stderr)
        return 2
    q, k_pool, v_pool, rows, tables, lens, out = make_step(
        a.batch, a.context, a.heads, a.kv_heads, a.head_dim, a.block_size,
        DTYPES[a.kv_cache_dtype])
    windows = [int(w) for w in a.windows.split(",")]
    times: dict[int, list[float]] = {w: [] for w in windows}
    scale = a.head_dim**-0.5
    for rep in range(a.reps + 2):  # two warm-up rounds
        for w in windows:
            start = time.perf_counter()
            lib.paged_decode(q, k_pool, v_pool, rows, tables, lens, scale, out, a.threads,
                             window=w)
            if rep >= 2:
                times[w].append(time.perf_counter() - start)
    print(f"batch {a.batch}, context {a.context}, {a.heads}/{a.kv_heads} heads x "
          f"{a.head_dim}, block {a.block_size}, {a.kv_cache_dtype}, {a.threads} threads, "
          f"{lib.isa}")
    base = statistics.median(times[windows[0]])
    for w in windows:
        ms = statistics.median(times[w]) * 1e3
        print(f"window {w or 'full':>6}: {ms:8.3f} ms/call  x{base * 1e3 / ms:5.2f} vs "
              f"window {windows[0] or 'full'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

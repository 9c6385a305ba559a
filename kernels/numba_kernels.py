"""The compiled part of the numba backend: paged decode attention over K/V blocks in place.

One sequence's single query row attends to its ``context_len`` cached positions, which
live at ``k_cache[table[p // block_size], p % block_size]``. Blocks are read front to back
once, in table order, with an online softmax per query head (GQA: query head ``j`` reads KV
head ``j // (Hq // Hkv)``). Everything is float32. Under a sliding window W > 0
(kernels/attention.py) only positions [context_len - W, context_len) are read: the walk starts
at the block holding the first of them.

Compiled with ``cache=True``: the first process compiles (~6 s on 2 idle cores) and writes
the machine code next to this file (or under ``NUMBA_CACHE_DIR``); later processes load it
(~0.5 s). Editing this file invalidates the cache.
"""

from __future__ import annotations

import ctypes
import pathlib

import numba
import numpy as np
import torch


def _share_torch_openmp() -> str:
    """Makes numba's parallel kernels run on torch's own OpenMP threads; returns the layer.

    numba's "omp" layer links a second libgomp whose workers fight torch's spinning ones
    for the cores; binding numba's pool to torch's libgomp (promoted to the global symbol
    scope before numba loads it) gives one team for both: attention 250 -> 150-185 ms a
    step at batch 64 (docs/executor-performance.md). Without a bundled libgomp numba gets
    "workqueue" (not re-entrant: the runner has one thread). NUMBA_THREADING_LAYER wins.
    """
    if numba.config.THREADING_LAYER != "default":
        return numba.config.THREADING_LAYER
    bundled = sorted((pathlib.Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if bundled:
        ctypes.CDLL(str(bundled[0]), mode=ctypes.RTLD_GLOBAL)
        numba.config.THREADING_LAYER = "omp"
    else:
        numba.config.THREADING_LAYER = "workqueue"
    return numba.config.THREADING_LAYER


THREADING_LAYER = _share_torch_openmp()

# fastmath without "ninf": reassociation vectorizes the dot products and sums, "nnan" the
# max reductions (~25 % faster), while the running max may still start at -inf.
_FAST = {"reassoc", "contract", "nsz", "arcp", "afn", "nnan"}  # numba wants a set


@numba.njit(fastmath=_FAST, cache=True, inline="always")
def _exp_below(x, top, t0, n, ints, scales):
    """x[t0:n] = exp(x[t0:n] - top) for x <= top, without a libm call per element, so the loop
    vectorizes (a call to expf per score was ~15 % of the kernel). 2^k * 2^f with
    |f| <= 1/2 and a degree-6 Taylor polynomial for 2^f: relative error ~1e-7. Arguments
    below -87 are clamped (exp(-87) ~ 1e-38 is still a normal float). ``ints`` (int32) and
    ``scales`` (float32) are two views of one scratch buffer of >= n elements."""
    for t in range(t0, n):
        v = max(x[t] - top, np.float32(-87.0)) * np.float32(1.4426950408889634)  # log2(e)
        k = np.floor(v + np.float32(0.5))
        f = v - k
        ints[t] = (np.int32(k) + np.int32(127)) << np.int32(23)  # the bits of 2.0 ** k
        x[t] = np.float32(1.0) + f * (np.float32(0.6931472) + f * (np.float32(0.2402265) + f * (
            np.float32(0.05550411) + f * (np.float32(0.009618129) + f * (
                np.float32(0.001333355) + f * np.float32(0.0001540353))))))
    for t in range(t0, n):
        x[t] *= scales[t]


@numba.njit(fastmath=_FAST, cache=True, inline="always")
def _attend(i, q, k_cache, v_cache, rows, tables, context_lens, scale, out, window):
    """Sequence ``i`` of the batch: writes out[rows[i]] ([Hq, D]); ``window`` 0: full."""
    block_size, num_kv_heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads  # query heads per KV head (GQA)
    row, ctx = rows[i], context_lens[i]
    lo = max(0, ctx - window) if window > 0 else 0  # the first position attended
    qs = np.empty((num_heads, dim), np.float32)  # queries, pre-scaled
    for j in range(num_heads):
        for d in range(dim):
            qs[j, d] = q[row, j, d] * scale
    acc = np.zeros((num_heads, dim), np.float32)  # sum of exp(s - m) * v
    m = np.full(num_heads, -np.inf, np.float32)  # running max score
    denom = np.zeros(num_heads, np.float32)  # running sum of exp(s - m)
    p = np.empty((num_heads, block_size), np.float32)  # a block's scores, then weights
    ints = np.empty(block_size, np.int32)  # scratch for _exp_below
    scales = ints.view(np.float32)
    for b in range(lo // block_size, (ctx + block_size - 1) // block_size):
        block = tables[i, b]
        t0 = max(0, lo - b * block_size)  # the window's first block may start part-way
        n = min(block_size, ctx - b * block_size)  # the last block may be partly filled
        for t in range(t0, n):
            for h in range(num_kv_heads):
                for j in range(h * group, (h + 1) * group):
                    s = np.float32(0.0)
                    for d in range(dim):
                        s += qs[j, d] * k_cache[block, t, h, d]
                    p[j, t] = s
        for j in range(num_heads):
            block_max = m[j]
            for t in range(t0, n):
                block_max = max(block_max, p[j, t])
            if block_max > m[j]:  # rescale what was accumulated under the old max
                correction = np.exp(m[j] - block_max)
                denom[j] *= correction
                for d in range(dim):
                    acc[j, d] *= correction
                m[j] = block_max
            _exp_below(p[j], block_max, t0, n, ints, scales)
            for t in range(t0, n):
                denom[j] += p[j, t]
        for t in range(t0, n):
            for h in range(num_kv_heads):
                for j in range(h * group, (h + 1) * group):
                    w = p[j, t]
                    for d in range(dim):
                        acc[j, d] += w * v_cache[block, t, h, d]
    for j in range(num_heads):
        inv = np.float32(1.0) / denom[j]
        for d in range(dim):
            out[row, j, d] = acc[j, d] * inv


# Both kernels take the same arguments:
#   q [T, Hq, D], out [T, Hq, D]: this step's query rows; only rows[i] of out is written
#   k_cache, v_cache [num_blocks, block_size, Hkv, D]: one layer's pools
#   rows [B], context_lens [B], tables [B, nb] int64: per single-token sequence
#   scale: float (1 / sqrt(D)); window: int, the sliding window (0: full attention)


@numba.njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def paged_decode(q, k_cache, v_cache, rows, tables, context_lens, scale, out, window):
    # One task per sequence, all heads: a block ([block_size, Hkv, D], 12 KiB for the bundled
    # model) is then read front to back, which the hardware prefetcher follows; a task per
    # (sequence, KV head) reads every third 256-byte row and ran ~2x slower. Callers set
    # numba's parallel chunk size to 1 so that unequal context lengths still balance.
    scale32 = np.float32(scale)
    for i in numba.prange(rows.shape[0]):
        _attend(i, q, k_cache, v_cache, rows, tables, context_lens, scale32, out, window)


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def paged_decode_serial(q, k_cache, v_cache, rows, tables, context_lens, scale, out, window):
    # In the calling thread: for small steps, where waking numba's workers costs more
    # than they save.
    scale32 = np.float32(scale)
    for i in range(rows.shape[0]):
        _attend(i, q, k_cache, v_cache, rows, tables, context_lens, scale32, out, window)

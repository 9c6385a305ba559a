"""Attention that reads K/V blocks in place through a compiled kernel (the CPU default).

Single-token rows go to ``kernels/cpu_attention.cpp`` (AVX2, kernels/native.py) or, where
that cannot run (or head dim % 8 != 0), ``kernels/numba_kernels.py``: one task per sequence
walks its table, each K/V row read once and nothing gathered (the gather alone costs ~2x
the attention, docs/facts.md); blocks before a sliding window are not read. Multi-token
chunks take torch's SDPA (a matmul beats a scalar loop). The constructor builds or loads
the kernels, so that cost lands at start-up. float32 only; other dtypes and
non-contiguous pools fall back to the torch backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numba
import numpy as np
import torch

from kernels import native
from kernels.attention import AttentionBackend, AttentionMetadata, check_window
from kernels.numba_kernels import paged_decode, paged_decode_serial
from kernels.torch_backend import TorchAttentionBackend, chunk_attention, plan_chunk

# Below this many context tokens in a step's decode rows (~60 us of kernel on one core),
# the kernel runs in the calling thread: starting a parallel region costs more than it saves.
# The threads are hot from the layer's GEMMs, so a region costs microseconds: at 4096 (the
# old value) a batch-8 step at context 192 ran its attention on one of two cores, 10.8 of a
# 46 ms step; at 256, 40-43 ms (bench_executor --batches 8 --context 192, A/B twice).
PARALLEL_MIN_TOKENS = 512


@dataclass
class _StepPlan:
    meta: AttentionMetadata
    rows: np.ndarray  # [Bs] int64, query row of each single-token sequence
    tables: np.ndarray  # [Bs, nb] int64
    context_lens: np.ndarray  # [Bs] int64
    chunks: tuple  # torch_backend chunk plans, one per multi-token sequence
    kernel: object  # paged_decode (threads) or paged_decode_serial (this thread)
    threads: int  # for the native kernel: 1 = this thread, as paged_decode_serial
    torch_plan: object = field(default=None)  # built only if a non-fp32 step needs it


class NumbaAttentionBackend(AttentionBackend):
    """Decode rows through the numba kernels, chunks through SDPA; CPU tensors only."""

    def __init__(self, kernel: str = "auto", warm_up: bool = True, use_native: bool = True,
                 native_options: native.NativeOptions | None = None) -> None:
        """``kernel``: "auto" (threads for big steps), "parallel" or "serial" (for tests).
        ``use_native``: the AVX2 kernel where it builds (False: numba only, for tests);
        ``native_options``: how it loads (the executor's switches; None: the defaults)."""
        if kernel not in ("auto", "parallel", "serial"):
            raise ValueError(f"kernel must be auto, parallel or serial, not {kernel!r}")
        self.kernel = kernel
        self._torch = TorchAttentionBackend()
        start = time.perf_counter()
        # Built on a first start, loaded from the cache later.
        self.native = native.load(native_options) if use_native else None
        self.native_s = time.perf_counter() - start
        self.warm_up_s = self.warm_up() if warm_up else 0.0

    @staticmethod
    def warm_up() -> float:
        """Compiles the kernels (or loads them from numba's cache); returns the seconds spent."""
        start = time.perf_counter()
        _match_torch_threads()
        q = np.zeros((1, 1, 1), np.float32)
        cache = np.zeros((1, 1, 1, 1), np.float32)
        one = np.zeros(1, np.int64)
        for kernel in (paged_decode, paged_decode_serial):
            kernel(q, cache, cache, one, np.zeros((1, 1), np.int64), one + 1, 1.0,
                   np.empty_like(q), 0)
        return time.perf_counter() - start

    def prepare(self, meta: AttentionMetadata) -> _StepPlan:
        if meta.block_tables.device.type != "cpu":
            raise ValueError("the numba attention backend runs on CPU tensors only")
        threads = _match_torch_threads()
        singles = [i for i, n in enumerate(meta.query_lens) if n == 1]
        idx = np.asarray(singles, dtype=np.int64)
        context_lens = np.asarray(meta.context_lens, dtype=np.int64)[idx]
        parallel = self.kernel == "parallel" or (
            self.kernel == "auto" and threads > 1 and context_lens.sum() >= PARALLEL_MIN_TOKENS)
        return _StepPlan(
            meta=meta,
            rows=meta.query_start.numpy()[idx],
            tables=np.ascontiguousarray(meta.block_tables.numpy()[idx]),
            context_lens=context_lens,
            chunks=tuple(plan_chunk(meta, i) for i, n in enumerate(meta.query_lens) if n > 1),
            kernel=paged_decode if parallel else paged_decode_serial,
            threads=threads if parallel else 1,
        )

    def native_plan(self, prepared: _StepPlan, pool: torch.Tensor, head_dim: int):
        """(rows, tables, context_lens, threads, chunks): the step's attention as this
        backend runs it — decode rows through the AVX2 kernel, chunks through SDPA — when the
        kernel reads ``pool`` (the whole KV pool); the step's layers may then run in one
        native call (kernels/cpu_decoder.cpp), each layer under its own window (the
        NativeDecoder's ``windows``). None when it does not."""
        native_ok = self.native is not None and self.native.supports(head_dim)
        if not native_ok or not _pools_readable((pool,), native_ok):
            return None
        return (prepared.rows, prepared.tables, prepared.context_lens, prepared.threads,
                prepared.chunks)

    def forward(self, q, k, v, k_cache, v_cache, prepared: _StepPlan, scale: float,
                window: int | None = None):
        window = check_window(window)
        native_ok = self.native is not None and self.native.supports(q.shape[-1])
        if not _kernel_can_read(q, k_cache, v_cache, native_ok):
            if prepared.torch_plan is None:
                prepared.torch_plan = self._torch.prepare(prepared.meta)
            return self._torch.forward(q, k, v, k_cache, v_cache, prepared.torch_plan, scale,
                                       window)
        q = q.contiguous()
        out = torch.empty_like(q)  # [T, Hq, D]
        if len(prepared.rows):
            rest = (prepared.rows, prepared.tables, prepared.context_lens, scale, out.numpy())
            if native_ok:
                self.native.paged_decode(q.numpy(), k_cache, v_cache, *rest,
                                         threads=prepared.threads, window=window)
            else:
                # Hand sequences to threads one at a time (setting it inside the kernel would
                # stop numba from caching it).
                chunk_size = numba.set_parallel_chunksize(1)
                prepared.kernel(q.numpy(), k_cache.numpy(), v_cache.numpy(), *rest, window)
                numba.set_parallel_chunksize(chunk_size)
        for c in prepared.chunks:
            out[c.start : c.end] = chunk_attention(q, k, v, k_cache, v_cache, c, scale, window)
        return out


def _match_torch_threads() -> int:
    """numba launches as many threads as torch uses (--threads), never more."""
    wanted = torch.get_num_threads()
    threads = min(wanted, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(threads)
    # The first call starts numba's pool, which sets the OpenMP thread count it shares with
    # torch (kernels/numba_kernels.py) to numba's default: put torch's back.
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return threads


def _kernel_can_read(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     native_ok: bool) -> bool:
    # The kernels take float32 queries and C-contiguous pools (KVCache's are) of float32 —
    # or, for the AVX2 kernel, float16 / bfloat16 (--kv-cache-dtype); any other layout would
    # make numba compile a new specialization mid-request.
    return q.dtype == torch.float32 and _pools_readable((k_cache, v_cache), native_ok)


def _pools_readable(pools: tuple[torch.Tensor, ...], native_ok: bool) -> bool:
    """The pools share one dtype the kernel reads and are C-contiguous."""
    pool_types = tuple(native.KV_KINDS) if native_ok else (torch.float32,)
    return len({t.dtype for t in pools}) == 1 and all(
        t.dtype in pool_types and t.is_contiguous() for t in pools)

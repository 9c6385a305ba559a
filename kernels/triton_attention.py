"""Paged attention and the KV write through Triton kernels (kernels/triton_kernels.py).

Decode rows (query_len 1) take ``decode_split_kernel``: one program per (row, KV head,
split) reads its blocks in place, all the head's GQA query heads at once; a long context is
cut into splits (split-K) that ``decode_reduce_kernel`` merges, so a batch of a few long
sequences still fills the GPU. Multi-token chunks (prefill, chunked prefill, recompute) take
``prefill_kernel``: varlen rows, causal within the chunk, full over the cached prefix.
Nothing is gathered out of the blocks, unlike kernels/torch_backend.py. A sliding window
(kernels/attention.py) launches the kernels' SLIDING variants, which read only the window.

Triton is imported lazily: this module imports anywhere, ``available()`` says whether the
kernels can run (a CUDA device, or TRITON_INTERPRET=1 on the CPU, as the tests run them),
and kernels/__init__.py's automatic choice skips the backend where they cannot.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field

import torch

from kernels.attention import AttentionBackend, AttentionMetadata, check_window

# Launch shapes: tl.dot needs every dimension >= 16. Chosen where sm_90 builds keep every
# value in registers (python -m kernels.triton_aot, bf16, 8B shape): decode 186 registers,
# prefill 219, no spills; 4 warps, or 64-position prefill tiles, spill 0.8-2 KB a thread.
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 32
LAUNCH = {"num_warps": 8, "num_stages": 2}
MAX_SPLITS = 16
MIN_SPLIT_LEN = 256  # a split shorter than this costs more in the reduction than it saves


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU through triton's numpy interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_installed() -> bool:
    """triton imports (a wheel built for another Python or CUDA can be present and fail)."""
    try:
        if importlib.util.find_spec("triton") is None:
            return False
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def available(device="cuda") -> bool:
    """Whether the kernels can run on ``device``: triton installed and a CUDA device, or
    a CPU device under the interpreter."""
    device = torch.device(device)
    if not triton_installed():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and interpreting()


def _kernels():
    from kernels import triton_kernels  # imports triton: only once it is known to be there

    return triton_kernels


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _dot_f32(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Matmul inputs in float32 unless q and the cache share a 16-bit type that tensor cores
    take; the interpreter has no bfloat16 arithmetic."""
    if q.dtype != cache.dtype or cache.dtype == torch.float32:
        return True
    return cache.dtype == torch.bfloat16 and interpreting()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(num_rows: int, num_kv_heads: int, max_context: int, device) -> int:
    """Context splits per decode row: enough programs to fill the device twice over, never
    a split under MIN_SPLIT_LEN positions, at most MAX_SPLITS."""
    device = torch.device(device)
    target = 2 * (_sm_count(device.index or 0) if device.type == "cuda" else 8)
    programs = max(1, num_rows * num_kv_heads)
    want = -(-target // programs)
    return max(1, min(MAX_SPLITS, want, -(-max_context // MIN_SPLIT_LEN)))


@dataclass
class TritonStepPlan:
    """Per-step index tensors on the device (one upload), shared by every layer."""

    meta: AttentionMetadata
    context_lens: torch.Tensor  # [B] int64
    decode_seqs: torch.Tensor | None  # [Bd] int64: the sequences with one query row
    chunk_seqs: torch.Tensor | None  # [Bc] int64: the sequences with several
    max_decode_context: int
    max_chunk_len: int
    scratch: dict = field(default_factory=dict)  # split-K buffers, allocated on first use


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels behind the attention interface; any pool dtype (fp32/fp16/bf16).

    ``num_splits`` fixes the decode split count (tests force split-K on; a CUDA graph needs
    launch shapes that do not change with the context); None: ``choose_splits`` per step.
    ``block_n`` / ``block_m`` override the context / query tiles (the interpreter tests use 16
    to walk many tiles); None: the tuned defaults above.
    """

    def __init__(self, num_splits: int | None = None, block_n: int | None = None,
                 block_m: int | None = None) -> None:
        if not triton_installed():
            raise ValueError("the triton attention backend needs the triton package "
                             "(pip install 'continuum[gpu]')")
        self.num_splits = num_splits
        self.decode_block_n = block_n or DECODE_BLOCK_N
        self.prefill_block_n = block_n or PREFILL_BLOCK_N
        self.block_m = block_m or PREFILL_BLOCK_M

    def prepare(self, meta: AttentionMetadata) -> TritonStepPlan:
        decode = [i for i, n in enumerate(meta.query_lens) if n == 1]
        chunks = [i for i, n in enumerate(meta.query_lens) if n > 1]
        b = meta.num_seqs
        host = torch.tensor([*meta.context_lens, *decode, *chunks], dtype=torch.int64)
        dev = host.to(meta.block_tables.device, non_blocking=True)
        return TritonStepPlan(
            meta=meta,
            context_lens=dev[:b],
            decode_seqs=dev[b : b + len(decode)] if decode else None,
            chunk_seqs=dev[b + len(decode) :] if chunks else None,
            max_decode_context=max((meta.context_lens[i] for i in decode), default=0),
            max_chunk_len=max((meta.query_lens[i] for i in chunks), default=0),
        )

    def forward(self, q, k, v, k_cache, v_cache, prepared: TritonStepPlan, scale: float,
                window: int | None = None):
        window = check_window(window)
        out = torch.empty_like(q)  # [T, Hq, D]
        if prepared.decode_seqs is not None:
            self._decode(q, k_cache, v_cache, prepared, scale, out, window)
        if prepared.chunk_seqs is not None:
            self._prefill(q, k_cache, v_cache, prepared, scale, out, window)
        return out

    def _decode(self, q, k_cache, v_cache, plan: TritonStepPlan, scale, out, window) -> None:
        rows = plan.decode_seqs.shape[0]
        hq, dim = q.shape[1], q.shape[2]
        hkv = k_cache.shape[2]
        longest = min(plan.max_decode_context, window or plan.max_decode_context)
        splits = self.num_splits or choose_splits(rows, hkv, longest, q.device)
        part_o = part_lse = out  # unused with one split
        if splits > 1:
            key = (rows, hq, splits, dim)
            if key not in plan.scratch:  # one pair of buffers for every layer of the step
                plan.scratch[key] = (
                    torch.empty((rows, hq, splits, dim), dtype=torch.float32, device=q.device),
                    torch.empty((rows, hq, splits), dtype=torch.float32, device=q.device))
            part_o, part_lse = plan.scratch[key]
        kern = _kernels()
        kern.decode_split_kernel[(rows, hkv, splits)](
            q, k_cache, v_cache, plan.meta.block_tables, plan.context_lens,
            plan.meta.query_start, plan.decode_seqs, out, part_o, part_lse,
            scale * kern.LOG2E, *_strides(q, out, k_cache, v_cache, plan),
            hq, window, GROUP=hq // hkv, HEAD_DIM=dim, BLOCK_H=_pow2(hq // hkv),
            BLOCK_N=self.decode_block_n, BLOCK_D=_pow2(dim), NUM_SPLITS=splits,
            DOT_F32=_dot_f32(q, k_cache), SLIDING=window > 0, **LAUNCH)
        if splits > 1:
            kern.decode_reduce_kernel[(rows, hq)](
                part_o, part_lse, plan.meta.query_start, plan.decode_seqs, out,
                out.stride(0), out.stride(1), hq, HEAD_DIM=dim, BLOCK_D=_pow2(dim),
                NUM_SPLITS=splits, BLOCK_S=_pow2(splits, floor=2))

    def _prefill(self, q, k_cache, v_cache, plan: TritonStepPlan, scale, out, window) -> None:
        chunks = plan.chunk_seqs.shape[0]
        hq, dim = q.shape[1], q.shape[2]
        tiles = -(-plan.max_chunk_len // self.block_m)
        kern = _kernels()
        kern.prefill_kernel[(chunks, hq, tiles)](
            q, k_cache, v_cache, plan.meta.block_tables, plan.context_lens,
            plan.meta.query_start, plan.chunk_seqs, out, scale * kern.LOG2E,
            *_strides(q, out, k_cache, v_cache, plan), window,
            GROUP=hq // k_cache.shape[2], HEAD_DIM=dim, BLOCK_M=self.block_m,
            BLOCK_N=self.prefill_block_n, BLOCK_D=_pow2(dim), DOT_F32=_dot_f32(q, k_cache),
            SLIDING=window > 0, **LAUNCH)


def _strides(q, out, k_cache, v_cache, plan: TritonStepPlan) -> tuple[int, ...]:
    """The shared stride arguments; every kernel needs the head dim contiguous."""
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton attention needs {name}'s last dim contiguous")
    return (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            plan.meta.block_tables.stride(0), k_cache.shape[1])


def kv_write(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    slot_mapping: torch.Tensor,  # [T] int64, slot = block * block_size + offset; < 0: skip
) -> None:
    """One launch writes a step's K and V, converted to the cache dtype (what KVCache.write
    does with two index_copy_ calls and the conversions)."""
    if k.shape[0] == 0:
        return
    if k_cache.stride() != v_cache.stride() or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("kv_write needs K/V caches of one layout and contiguous head dims")
    hkv, dim = k.shape[1], k.shape[2]
    _kernels().kv_write_kernel[(k.shape[0],)](
        k, v, slot_mapping, k_cache, v_cache, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], NUM_KV_HEADS=hkv, HEAD_DIM=dim, BLOCK=_pow2(hkv * dim, floor=1))

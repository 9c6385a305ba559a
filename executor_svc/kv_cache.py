"""The KV cache tensors: a device pool of fixed-size blocks, plus an optional host (swap) pool.

Layout of each pool: ``[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]``, so a
block's K and V for every layer move with one indexed copy. The executor never decides which
block holds what: block ids and slots come from the scheduler's plan, checked by the runner
before they reach this module.
"""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass

import torch

from kernels import native


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one token's KV across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @property
    def token_bytes(self) -> int:
        # K and V, every layer, every KV head.
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.block_size

    def num_blocks(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.block_bytes)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages are 2 MiB where the kernel allows it.

    Attention reads a step's blocks from anywhere in a pool of gigabytes: with 4 KiB pages
    nearly every block costs TLB misses (decode attention 7 % faster on huge pages, batch
    64 x 512). Transparent huge pages are usually "madvise" only, so the pool asks for
    them before its first touch; where that fails (another OS, THP off) nothing changes.
    """
    pool = torch.empty(shape, dtype=dtype)
    start = -(-pool.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (pool.data_ptr() + pool.numel() * pool.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end > start and sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise(start, end - start, _MADV_HUGEPAGE)  # advice: failure is harmless
        except (OSError, AttributeError):
            pass
    return pool.zero_()


class KVCache:
    """Owns the pools; writes this step's K/V into the slots the plan assigned.

    Pools start zeroed: attention may read (and mask out) never-written slots of a partly
    filled block, and masked garbage would still poison the output if it were NaN.
    """

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, num_host_blocks: int = 0, device="cpu", *,
        native_options: native.NativeOptions | None = None,  # the executor's (settings.py)
    ) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"KV budget too small: one block of {spec.block_size} tokens needs "
                f"{spec.block_bytes} bytes"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.device_pool = (_zeros_on_huge_pages(shape, spec.dtype)
                            if torch.device(device).type == "cpu" else
                            torch.zeros(shape, dtype=spec.dtype, device=device))
        # On the CPU, writes go through one native call (~2 us) instead of two index_copy_
        # (~60 us each: 7 ms of a batch-64 step), for every pool dtype the kernels take.
        native_pool = self.device_pool.device.type == "cpu" and spec.dtype in native.KV_KINDS
        self._native = native.load(native_options) if native_pool else None
        # With a GPU pool the host pool is pinned: swaps are then DMA transfers, not copies
        # staged through a driver buffer.
        self._pinned = self.device_pool.device.type == "cuda"
        self.host_pool = torch.zeros((*shape[:2], num_host_blocks, *shape[3:]), dtype=spec.dtype,
                                     pin_memory=self._pinned)

    def key_cache(self, layer: int) -> torch.Tensor:  # [num_blocks, block_size, Hkv, D]
        return self.device_pool[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:  # [num_blocks, block_size, Hkv, D]
        return self.device_pool[layer, 1]

    def write(
        self,
        layer: int,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64, slot = block_id * block_size + offset
    ) -> None:
        hkv, dim = self.spec.num_kv_heads, self.spec.head_dim
        if (self._native is not None and k.dtype == v.dtype == torch.float32
                and k.is_contiguous() and v.is_contiguous()):
            self._native.kv_write(k, v, self.device_pool[layer, 0], self.device_pool[layer, 1],
                                  slot_mapping)
            return
        # A contiguous pool's [num_blocks, block_size] prefix flattens to slots. A pool in
        # a narrower dtype than the model (--kv-cache-dtype) stores the rounded values.
        dtype = self.device_pool.dtype
        self.device_pool[layer, 0].view(-1, hkv, dim).index_copy_(0, slot_mapping, k.to(dtype))
        self.device_pool[layer, 1].view(-1, hkv, dim).index_copy_(0, slot_mapping, v.to(dtype))

    def swap(
        self, out_src: list[int], out_dst: list[int], in_src: list[int], in_dst: list[int]
    ) -> None:
        """One step's swaps: device ``out_src[i]`` -> host ``out_dst[i]`` and host
        ``in_src[i]`` -> device ``in_dst[i]``. Every read happens before any write, so a block
        one direction frees may be reused by the other in the same step."""
        device = self.device_pool.device
        # Indexing with a list copies: these are snapshots, safe from the writes below.
        if self._pinned:  # both directions go through pinned staging
            outgoing = _pinned_copy(self.device_pool[:, :, out_src]) if out_src else None
            incoming = (_pinned_gather(self.host_pool, in_src).to(device, non_blocking=True)
                        if in_src else None)
        else:
            outgoing = self.device_pool[:, :, out_src].cpu() if out_src else None
            incoming = self.host_pool[:, :, in_src].to(device) if in_src else None
        if outgoing is not None:
            self.host_pool[:, :, out_dst] = outgoing
        if incoming is not None:
            self.device_pool[:, :, torch.tensor(in_dst, device=device)] = incoming

    def copy(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Device-to-device block copies, pairwise (copy-on-write)."""
        if src_blocks:
            device = self.device_pool.device
            src = torch.tensor(src_blocks, device=device)
            dst = torch.tensor(dst_blocks, device=device)
            self.device_pool[:, :, dst] = self.device_pool[:, :, src]

    def measure_copy_bytes_per_s(self, max_blocks: int = 16) -> float:
        """Device -> host copy bandwidth for the preemption cost model (a few ms): into
        pinned memory from a GPU, as swaps copy."""
        n = min(max_blocks, self.num_blocks)
        blocks = self.device_pool[:, :, :n]
        dst = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=self._pinned)
        dst.copy_(blocks)  # warm the pages
        if self._pinned:  # time the transfer itself, not whatever was queued before it
            torch.cuda.synchronize(blocks.device)
        start = time.perf_counter()
        dst.copy_(blocks)
        if self._pinned:
            torch.cuda.synchronize(blocks.device)
        elapsed = time.perf_counter() - start
        return n * self.spec.block_bytes / max(elapsed, 1e-9)


def _pinned_copy(blocks: torch.Tensor) -> torch.Tensor:
    """GPU blocks -> a pinned host copy; returns once the copy has landed."""
    out = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
    return out.copy_(blocks)


def _pinned_gather(pool: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """Host pool blocks (dim 2) gathered into pinned memory, ready for an async upload."""
    index = torch.tensor(blocks, dtype=torch.int64)
    out = torch.empty((*pool.shape[:2], len(blocks), *pool.shape[3:]), dtype=pool.dtype,
                      pin_memory=True)
    return torch.index_select(pool, 2, index, out=out)

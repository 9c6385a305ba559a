"""Paged attention through flash-attn's varlen kernel reading the blocks (``block_table``).

One ``flash_attn_varlen_func`` call per layer covers the whole step: ``cu_seqlens_q`` is
the metadata's query_start, ``cu_seqlens_k`` the running sum of context lengths, and
flash-attn's causal mask is aligned to the bottom right (since 2.1), which is exactly "row j
of a chunk sees positions <= ctx - n + j". K/V are read through the block table in place.

A sliding window W (p - W < k <= p) is flash-attn's ``window_size=(W - 1, 0)`` under its
bottom-right alignment; full attention leaves it out. What it cannot take goes to a
fallback (Triton, else torch), logged once per reason: pages not a multiple of 256 tokens
(the default ``--block-size 16``), q and pool not one 16-bit dtype, head dims over 256.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend, AttentionMetadata, check_window

log = logging.getLogger(__name__)

PAGE_MULTIPLE = 256  # flash-attn 2's paged KV: page_block_size % 256 == 0
MAX_HEAD_DIM = 256


def importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or a build for another torch/CUDA failing to load
        return False
    return True


@dataclass
class _FlashPlan:
    meta: AttentionMetadata
    cu_seqlens_q: torch.Tensor | None  # [B + 1] int32; None: the fallback serves the step
    cu_seqlens_k: torch.Tensor | None  # [B + 1] int32
    block_table: torch.Tensor | None  # [B, max_blocks] int32
    fallback_plan: object = None  # the fallback's prepare(), made when first needed


class FlashAttnBackend(AttentionBackend):
    """flash-attn where it can serve the step, ``fallback`` where it cannot."""

    def __init__(self, fallback: AttentionBackend, varlen_func=None) -> None:
        """``varlen_func``: flash-attn's ``flash_attn_varlen_func`` (None: imported here)."""
        if varlen_func is None:
            from flash_attn import flash_attn_varlen_func as varlen_func
        self._varlen = varlen_func
        self.fallback = fallback
        self._said: set[str] = set()

    def _decline(self, reason: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            log.warning("flash-attn cannot serve this (%s); using %s attention", reason,
                        type(self.fallback).__name__)

    def prepare(self, meta: AttentionMetadata) -> _FlashPlan:
        if meta.block_size % PAGE_MULTIPLE:
            self._decline(f"--block-size {meta.block_size} is no multiple of {PAGE_MULTIPLE}")
            return _FlashPlan(meta, None, None, None, self.fallback.prepare(meta))
        device = meta.block_tables.device
        ctx = torch.tensor([0, *meta.context_lens], dtype=torch.int32).cumsum_(0)
        return _FlashPlan(
            meta,
            cu_seqlens_q=meta.query_start.to(torch.int32),
            cu_seqlens_k=ctx.to(device, non_blocking=True),
            block_table=meta.block_tables.to(torch.int32),
        )

    def _reason(self, q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
        if q.dtype != k_cache.dtype or q.dtype not in (torch.float16, torch.bfloat16):
            return f"q {q.dtype} over a {k_cache.dtype} pool; it takes fp16/bf16 for both"
        if q.shape[-1] > MAX_HEAD_DIM or q.shape[-1] % 8:
            return f"head dim {q.shape[-1]}"
        return None

    def forward(self, q, k, v, k_cache, v_cache, prepared: _FlashPlan, scale: float,
                window: int | None = None):
        window = check_window(window)
        reason = None if prepared.cu_seqlens_q is None else self._reason(q, k_cache)
        if prepared.cu_seqlens_q is None or reason is not None:
            if reason is not None:
                self._decline(reason)
            if prepared.fallback_plan is None:
                prepared.fallback_plan = self.fallback.prepare(prepared.meta)
            return self.fallback.forward(q, k, v, k_cache, v_cache, prepared.fallback_plan,
                                         scale, window)
        meta = prepared.meta
        return self._varlen(
            q, k_cache, v_cache, prepared.cu_seqlens_q, prepared.cu_seqlens_k,
            max(meta.query_lens), max(meta.context_lens), softmax_scale=scale, causal=True,
            block_table=prepared.block_table, **window_kwargs(window),
        )  # [T, Hq, D]


def window_kwargs(window: int) -> dict:
    """flash-attn's keyword for a sliding window (module docstring); {} for full attention."""
    return {"window_size": (window - 1, 0)} if window else {}

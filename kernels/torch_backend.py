"""Paged attention in plain torch: runs anywhere torch does.

Single-token rows are batched into one SDPA call over their gathered blocks; longer chunks
run one SDPA call per sequence (a chunk at position 0 reads nothing from the cache). Under
a sliding window only the blocks a window touches are gathered; each window's masks and
indices are built on the first layer that asks and cached in the step's plan. Gathering
costs ~2x the attention at long contexts (docs/facts.md): the in-place kernels are the
other backends; on a GPU this one is the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionMetadata, check_window, gather_context


@dataclass(frozen=True)
class ChunkPlan:
    """A multi-token query chunk of one sequence: rows [start, end) at positions
    [context_len - (end - start), context_len)."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # [nb] int64
    mask: torch.Tensor | None  # [n, context_len] bool (True = attend); None: causal, no prefix
    # window -> (first key position, [n, context_len - first] mask), built on first use
    windowed: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class _StepPlan:
    single_rows: torch.Tensor | None  # [Bs] row of each single-token sequence
    single_tables: torch.Tensor | None  # [Bs, nb] int64
    single_mask: torch.Tensor | None  # [Bs, 1, 1, nb * block_size] bool
    chunks: tuple[ChunkPlan, ...]
    single_ctx: tuple[int, ...] = ()  # context length of each single-token sequence
    block_size: int = 0
    # window -> (tables [Bs, span], mask [Bs, 1, 1, span * block_size]), built on first use
    windowed: dict = field(default_factory=dict, compare=False, repr=False)


class TorchAttentionBackend(AttentionBackend):
    """SDPA (with GQA) over blocks gathered through the block tables."""

    def prepare(self, meta: AttentionMetadata) -> _StepPlan:
        singles = [i for i, n in enumerate(meta.query_lens) if n == 1]
        chunks = tuple(plan_chunk(meta, i) for i, n in enumerate(meta.query_lens) if n > 1)
        if not singles:
            return _StepPlan(None, None, None, chunks)
        device = meta.block_tables.device
        idx = torch.tensor(singles, dtype=torch.int64, device=device)
        ctx = torch.tensor([meta.context_lens[i] for i in singles], device=device)
        num_blocks = -(-max(meta.context_lens[i] for i in singles) // meta.block_size)
        positions = torch.arange(num_blocks * meta.block_size, device=device)
        return _StepPlan(
            single_rows=meta.query_start[idx],
            single_tables=meta.block_tables[idx, :num_blocks],
            single_mask=(positions[None, :] < ctx[:, None])[:, None, None, :],
            chunks=chunks,
            single_ctx=tuple(meta.context_lens[i] for i in singles),
            block_size=meta.block_size,
        )

    def forward(self, q, k, v, k_cache, v_cache, prepared: _StepPlan, scale: float,
                window: int | None = None):
        window = check_window(window)
        out = torch.empty_like(q)  # [T, Hq, D]
        if prepared.single_rows is not None:
            tables, mask = prepared.single_tables, prepared.single_mask
            if window and window < max(prepared.single_ctx):
                tables, mask = _windowed_singles(prepared, window)
            out[prepared.single_rows] = self._singles(q, k_cache, v_cache, tables, mask,
                                                      prepared.single_rows, scale)
        for c in prepared.chunks:
            out[c.start : c.end] = chunk_attention(q, k, v, k_cache, v_cache, c, scale, window)
        return out

    @staticmethod
    def _singles(q, k_cache, v_cache, tables, mask, rows, scale: float) -> torch.Tensor:
        qs = q[rows].unsqueeze(2)  # [Bs, Hq, 1, D]
        # A cache narrower than q (--kv-cache-dtype) is widened as it is gathered.
        ks = _gather_blocks(k_cache, tables).to(q.dtype)  # [Bs, Hkv, nb * bs, D]
        vs = _gather_blocks(v_cache, tables).to(q.dtype)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [Bs, Hq, 1, D]
        return o.squeeze(2)


def _windowed_singles(plan: _StepPlan, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tables, mask) of the single-token rows under ``window``: row i's table starts at the
    block holding its window's first position, so only ``span`` blocks a row are gathered."""
    if window not in plan.windowed:
        bs, device = plan.block_size, plan.single_tables.device
        host_lo = [max(0, c - window) for c in plan.single_ctx]
        span = max((c - 1) // bs - lo // bs + 1 for c, lo in zip(plan.single_ctx, host_lo,
                                                                   strict=True))
        lo = torch.tensor(host_lo, device=device)
        ctx = torch.tensor(plan.single_ctx, device=device)
        cols = (lo // bs)[:, None] + torch.arange(span, device=device)[None, :]  # [Bs, span]
        last = plan.single_tables.shape[1] - 1  # columns past a row's table: masked out
        tables = plan.single_tables.gather(1, cols.clamp(max=last))
        pos = (lo // bs * bs)[:, None] + torch.arange(span * bs, device=device)[None, :]
        mask = (pos >= lo[:, None]) & (pos < ctx[:, None])
        plan.windowed[window] = (tables, mask[:, None, None, :])
    return plan.windowed[window]


def plan_chunk(meta: AttentionMetadata, i: int) -> ChunkPlan:
    """The attention plan of sequence ``i``'s multi-token chunk (shared by backends)."""
    start = int(meta.query_start[i])
    n, ctx = meta.query_lens[i], meta.context_lens[i]
    mask = None
    if ctx > n:  # a cached prefix: query j sits at position ctx - n + j
        device = meta.block_tables.device
        q_pos = torch.arange(ctx - n, ctx, device=device)
        mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
    return ChunkPlan(start, start + n, ctx, meta.block_tables[i], mask)


def _windowed_chunk(c: ChunkPlan, window: int) -> tuple[int, torch.Tensor]:
    """(first, mask): chunk ``c`` under ``window`` reads keys [first, context_len) only;
    mask [n, context_len - first] keeps q_pos - window < k_pos <= q_pos."""
    if window not in c.windowed:
        n, ctx, device = c.end - c.start, c.context_len, c.block_table.device
        first = max(0, ctx - n - window + 1)  # the chunk's first row's window start
        q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]
        k_pos = torch.arange(first, ctx, device=device)[None, :]
        c.windowed[window] = (first, (k_pos <= q_pos) & (k_pos > q_pos - window))
    return c.windowed[window]


def chunk_attention(q, k, v, k_cache, v_cache, c: ChunkPlan, scale: float,
                    window: int = 0) -> torch.Tensor:
    """[n, Hq, D]: one chunk's causal attention through SDPA (``window``: 0 or a sliding
    window, kernels/attention.py)."""
    qc = q[c.start : c.end].transpose(0, 1)  # [Hq, n, D]
    mask, first = c.mask, 0
    if window and window < c.context_len:  # else no key falls out of any row's window
        first, mask = _windowed_chunk(c, window)
    if c.mask is None and k is not None:  # whole context is this chunk: the fresh K/V
        kc, vc = k[c.start + first : c.end], v[c.start + first : c.end]  # [n - first, Hkv, D]
    else:  # [ctx - first, Hkv, D]
        kc = gather_context(k_cache, c.block_table, c.context_len, first).to(q.dtype)
        vc = gather_context(v_cache, c.block_table, c.context_len, first).to(q.dtype)
    # A leading batch dim of 1 matters: 4-D inputs take the CPU flash kernel, 3-D ones
    # the math path (3x slower at 512 tokens).
    o = F.scaled_dot_product_attention(
        qc[None],
        kc.transpose(0, 1)[None],
        vc.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )[0]  # [Hq, n, D]
    return o.transpose(0, 1)


def _gather_blocks(
    cache: torch.Tensor,  # [num_blocks, bs, Hkv, D]
    tables: torch.Tensor,  # [B, nb] int64
) -> torch.Tensor:  # [B, Hkv, nb * bs, D]
    # index_select on the flattened table is 2-4x faster than cache[tables] on the CPU.
    b, nb = tables.shape
    blocks = cache.index_select(0, tables.flatten())  # [B * nb, bs, Hkv, D]
    return blocks.view(b, nb * cache.shape[1], *cache.shape[2:]).transpose(1, 2)

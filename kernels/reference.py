"""The slow, obviously-correct paged attention that tests trust.

Token by token, head by head, in float64: look each key position up through the block
table, softmax over positions <= the query's own (and, under a sliding window W, > its own
- W: kernels/attention.py), weight the values. No batching, no masking tricks, no SDPA.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionBackend, AttentionMetadata, check_window, window_start


class ReferenceAttentionBackend(AttentionBackend):
    """Reads only the cache (never the fresh k/v), so it also checks that K/V were written."""

    def forward(self, q, k, v, k_cache, v_cache, prepared: AttentionMetadata, scale: float,
                window: int | None = None):
        meta = prepared
        window = check_window(window)
        out = torch.empty_like(q)  # [T, Hq, D]
        group = q.shape[1] // k_cache.shape[2]  # query heads per KV head
        for i in range(meta.num_seqs):
            start = int(meta.query_start[i])
            n, ctx = meta.query_lens[i], meta.context_lens[i]
            keys, values = self._context(k_cache, v_cache, meta.block_tables[i], ctx)
            for j in range(n):
                position = ctx - n + j  # attends keys [first, position]
                first = window_start(position, window)
                for h in range(q.shape[1]):
                    out[start + j, h] = self._one(
                        q[start + j, h], keys[first : position + 1, h // group],
                        values[first : position + 1, h // group], scale,
                    ).to(q.dtype)
        return out

    @staticmethod
    def _context(k_cache, v_cache, table, ctx: int):
        block_size = k_cache.shape[1]
        keys, values = [], []
        for p in range(ctx):
            block, offset = int(table[p // block_size]), p % block_size
            keys.append(k_cache[block, offset])  # [Hkv, D]
            values.append(v_cache[block, offset])
        return torch.stack(keys).double(), torch.stack(values).double()  # [ctx, Hkv, D]

    @staticmethod
    def _one(q_row, keys, values, scale: float) -> torch.Tensor:
        # q_row [D], keys/values [P, D] -> [D]
        scores = (keys @ q_row.double()) * scale  # [P]
        weights = torch.exp(scores - scores.max())
        weights = weights / weights.sum()
        return weights @ values

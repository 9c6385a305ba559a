"""The attention backend interface: causal attention over a paged KV cache.

One step's tokens arrive flattened: sequence ``i`` owns query rows
``query_start[i] : query_start[i + 1]`` (its ``query_lens[i]`` new tokens) and attends to key
positions ``[0, context_lens[i])`` — its cached prefix followed by its new tokens, whose K/V
the caller has already written into the cache. Position ``p`` of sequence ``i`` lives at
``block_tables[i, p // block_size]``, offset ``p % block_size``.

Chunked prefill, decode and recompute differ only in these numbers (docs/design.md §2), so a
backend sees one kind of batch. Backends: ``torch_backend`` (CPU/any device),
``reference`` (slow, trusted by tests); Triton / flash-attn ones plug in behind the same
two methods.

Sliding windows: ``forward(..., window=W)`` makes one layer's call local (Gemma 3
interleaves windowed and global layers): a query at position ``p`` attends to keys
``p - W < k <= p``, transformers' rule (masking_utils.py ``sliding_window_overlay``).
``window`` None or 0 is full causal attention, bit for bit as without windows; ``prepare``
stays window-free, and a backend caches per-window work in its prepared object. The
native decoder fixes windows per layer instead (``NativeDecoder(..., windows=...)``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Layout of one step's flattened batch; built once per step, shared by every layer.

    Host tuples let backends plan loops without device syncs; tensors live on the model's device.
    Invariants: 1 <= query_lens[i] <= context_lens[i];
    len(block_tables[i]) * block_size >= context_lens[i] for the real (unpadded) entries.
    """

    query_lens: tuple[int, ...]  # [B] new tokens per sequence this step
    context_lens: tuple[int, ...]  # [B] cached prefix + new tokens per sequence
    query_start: torch.Tensor  # [B + 1] int64, query_start[0] = 0, query_start[B] = T
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 (padding is never read)
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        width = max((len(t) for t in block_tables), default=0)
        table = np.zeros((len(block_tables), max(width, 1)), dtype=np.int64)
        for i, blocks in enumerate(block_tables):
            table[i, : len(blocks)] = blocks
        starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
        starts[1:] = np.cumsum(query_lens)
        return AttentionMetadata(
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            query_start=torch.from_numpy(starts).to(device),
            block_tables=torch.from_numpy(table).to(device),
            block_size=block_size,
        )


class AttentionBackend(ABC):
    """Computes paged causal attention; stateless between steps.

    ``prepare`` runs once per step (index building, masks); ``forward`` once per layer.
    """

    def prepare(self, meta: AttentionMetadata) -> object:
        """Per-step precomputation shared by all layers; passed back to ``forward``."""
        return meta

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D] this step's queries, rope applied
        k: torch.Tensor,  # [T, Hkv, D] this step's keys (already in the cache too)
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] this layer's cache
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        prepared: object,  # what prepare() returned for this step
        scale: float,
        window: int | None = None,  # sliding window W (module docstring); None / 0: full
    ) -> torch.Tensor:  # [T, Hq, D]
        """Each query row attends to its sequence's keys at positions <= its own (and, with
        a window W, > its own - W)."""


def check_window(window: int | None) -> int:
    """``window`` as an int, 0 for full attention; ValueError for a negative one."""
    if not window:
        return 0
    if window < 0:
        raise ValueError(f"a sliding window must be >= 1 (or None / 0: full), not {window}")
    return int(window)


def window_start(position: int, window: int) -> int:
    """The first key position a query at ``position`` attends to under ``window`` (0: full)."""
    return max(0, position - window + 1) if window else 0


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [nb] int64
    length: int,
    start: int = 0,
) -> torch.Tensor:  # [length - start, Hkv, D]
    """One sequence's cached positions [start, length), contiguous; only the blocks that
    hold them are read."""
    block_size = cache.shape[1]
    first, num_blocks = start // block_size, -(-length // block_size)
    blocks = cache.index_select(0, block_table[first:num_blocks])  # [nb, bs, Hkv, D]
    offset = first * block_size
    return blocks.flatten(0, 1)[start - offset : length - offset]

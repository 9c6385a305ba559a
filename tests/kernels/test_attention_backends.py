"""Every attention backend equals the slow reference on random paged batches."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention import AttentionMetadata
from kernels.reference import ReferenceAttentionBackend
from kernels.torch_backend import TorchAttentionBackend


def random_batch(seed: int, block_size: int, hq: int, hkv: int, dim: int, num_blocks: int = 64):
    """Sequences with random cached prefixes and new-token counts (decodes, chunks, fresh
    prompts), random non-contiguous block tables, and a cache holding every K/V."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, context_lens, tables = [], [], []
    for kind in ["decode", "chunk", "fresh", "decode", "chunk", "decode", "one-token-prompt"]:
        n = {"decode": 1, "one-token-prompt": 1}.get(kind, rng.randint(2, 3 * block_size))
        prefix = 0 if kind in ("fresh", "one-token-prompt") else rng.randint(1, 3 * block_size)
        query_lens.append(n)
        context_lens.append(prefix + n)
        tables.append([free.pop() for _ in range(-(-(prefix + n) // block_size))])
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    k_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen)
    # This step's K/V are the cache entries at the new positions (the model writes them first).
    rows = [
        (table[p // block_size], p % block_size)
        for n, ctx, table in zip(query_lens, context_lens, tables, strict=True)
        for p in range(ctx - n, ctx)
    ]
    k = torch.stack([k_cache[b, o] for b, o in rows])
    v = torch.stack([v_cache[b, o] for b, o in rows])
    q = torch.randn(len(rows), hq, dim, generator=gen)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize(
    ("seed", "block_size", "hq", "hkv", "dim"),
    [(0, 16, 9, 3, 64), (1, 4, 9, 3, 64), (2, 8, 4, 4, 32), (3, 1, 8, 2, 16)],
)
def test_torch_backend_matches_reference(seed, block_size, hq, hkv, dim):
    q, k, v, k_cache, v_cache, meta = random_batch(seed, block_size, hq, hkv, dim)
    scale = dim**-0.5
    ref_backend, torch_backend = ReferenceAttentionBackend(), TorchAttentionBackend()
    want = ref_backend.forward(q, k, v, k_cache, v_cache, ref_backend.prepare(meta), scale)
    got = torch_backend.forward(q, k, v, k_cache, v_cache, torch_backend.prepare(meta), scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_reference_is_causal_softmax_attention():
    # One fresh 3-token sequence, one KV head, block size 2: check against a hand formula.
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 2, 1, 8, generator=gen)
    v_cache = torch.randn(4, 2, 1, 8, generator=gen)
    table = [3, 1]
    keys = torch.stack([k_cache[3, 0], k_cache[3, 1], k_cache[1, 0]])[:, 0]  # [3, 8]
    values = torch.stack([v_cache[3, 0], v_cache[3, 1], v_cache[1, 0]])[:, 0]
    q = torch.randn(3, 1, 8, generator=gen)
    meta = AttentionMetadata.build([3], [3], [table], 2)
    backend = ReferenceAttentionBackend()
    out = backend.forward(q, None, None, k_cache, v_cache, backend.prepare(meta), 0.5)
    scores = (q[:, 0] @ keys.T) * 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(3, 3, dtype=torch.bool), 1), float("-inf"))
    torch.testing.assert_close(out[:, 0], torch.softmax(scores, -1) @ values)

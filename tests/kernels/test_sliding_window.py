"""Sliding-window attention: every CPU backend equals the reference, and the reference
equals dense attention under transformers' own sliding-window mask.

A window W lets position p see keys p - W < k <= p (kernels/attention.py). Steps mix decode
rows before and past the window, a chunk whose start is past the window (chunked prefill), a
chunk straddling it, a fresh prompt longer than it and a one-token prompt; windows smaller
than, equal to and larger than the contexts, with block sizes that do not divide them, and
GQA. Where a kernel claims to skip what lies before a window, those K/V slots hold NaN.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import check_window, window_start
from kernels.flash_attn_backend import FlashAttnBackend, window_kwargs
from kernels.numba_backend import NumbaAttentionBackend
from kernels.reference import ReferenceAttentionBackend
from kernels.torch_backend import TorchAttentionBackend
from tests.kernels.test_attention_backends import ATOL, RTOL, paged_batch

# (query_len, context_len): decode past the window, decode inside it, a chunk starting past
# it, a chunk straddling it, a fresh prompt longer than it, a one-token prompt, a decode at
# exactly 23 (the window 23 equals its context).
SPECS = [(1, 50), (1, 4), (5, 35), (12, 15), (25, 25), (1, 1), (1, 23)]
WINDOWS = [1, 7, 16, 23, 50, 64]  # 64: larger than every context
HQ, HKV, DIM = 4, 2, 16  # GQA 2


def batch_for(block_size: int, window: int, seed: int = 0, poison: bool = False):
    """A step over SPECS; ``poison``: NaN in every slot no sequence owns and in every
    position before each sequence's first window start (no row may read those)."""
    batch = paged_batch(seed, SPECS, block_size, HQ, HKV, DIM, poison=poison)
    if poison:
        poison_before_windows(batch, window)
    return batch


def poison_before_windows(batch, window: int) -> None:
    _, _, _, k_cache, v_cache, meta = batch
    bs = meta.block_size
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        for p in range(window_start(ctx - n, window)):  # the first row's window start
            block = int(meta.block_tables[i, p // bs])
            k_cache[block, p % bs] = float("nan")
            v_cache[block, p % bs] = float("nan")


def run(backend, batch, window):
    q, k, v, k_cache, v_cache, meta = batch
    return backend.forward(q, k, v, k_cache, v_cache, backend.prepare(meta), DIM**-0.5,
                           window=window)


def dense_transformers(batch, window: int) -> torch.Tensor:
    """float64 attention per sequence over its keys in order, masked by transformers'
    ``sliding_window_causal_mask_function`` at absolute positions."""
    masking = pytest.importorskip("transformers.masking_utils")
    q, _, _, k_cache, v_cache, meta = batch
    bs, group = meta.block_size, HQ // HKV
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        table = meta.block_tables[i]
        keys = torch.stack([k_cache[table[p // bs], p % bs] for p in range(ctx)]).double()
        values = torch.stack([v_cache[table[p // bs], p % bs] for p in range(ctx)]).double()
        q_idx, kv_idx = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
        mask = masking.sliding_window_causal_mask_function(window)(0, 0, q_idx, kv_idx)
        start = int(meta.query_start[i])
        for h in range(HQ):
            scores = q[start : start + n, h].double() @ keys[:, h // group].T * DIM**-0.5
            weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out[start : start + n, h] = weights @ values[:, h // group]
    return out


@pytest.mark.parametrize("window", [1, 3, 7, 16, 24, 50, 64])
@pytest.mark.parametrize("block_size", [5, 16])
def test_reference_equals_dense_attention_under_transformers_mask(block_size, window):
    batch = batch_for(block_size, window)
    got = run(ReferenceAttentionBackend(), batch, window).double()
    torch.testing.assert_close(got, dense_transformers(batch, window), atol=1e-6, rtol=1e-6)


def test_a_window_of_one_returns_each_rows_own_value():
    q, k, v, k_cache, v_cache, meta = batch = batch_for(5, 1)
    got = run(ReferenceAttentionBackend(), batch, 1)
    torch.testing.assert_close(got, v.repeat_interleave(HQ // HKV, dim=1))


def test_window_arguments_and_starts():
    assert check_window(None) == check_window(0) == 0 and check_window(7) == 7
    with pytest.raises(ValueError, match="sliding window"):
        check_window(-1)
    # transformers' rule: position 10 under window 4 sees 7, 8, 9, 10.
    assert window_start(10, 4) == 7 and window_start(2, 4) == 0 and window_start(10, 0) == 0


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [5, 16])
def test_torch_backend_matches_reference_under_windows(block_size, window):
    batch = batch_for(block_size, window, seed=block_size)
    want = run(ReferenceAttentionBackend(), batch, window)
    torch.testing.assert_close(run(TorchAttentionBackend(), batch, window), want,
                               atol=2e-5, rtol=1e-4)


def test_torch_backend_caches_each_windows_masks_in_the_step_plan():
    q, k, v, k_cache, v_cache, meta = batch_for(5, 7)
    backend = TorchAttentionBackend()
    plan = backend.prepare(meta)
    for window in (7, 16, 7, None, 16):  # Gemma-3-like: layers alternate their windows
        backend.forward(q, k, v, k_cache, v_cache, plan, DIM**-0.5, window=window)
    assert sorted(plan.windowed) == [7, 16]
    first = plan.windowed[7]
    backend.forward(q, k, v, k_cache, v_cache, plan, DIM**-0.5, window=7)
    assert plan.windowed[7] is first  # built once per step, not per layer
    # Decode rows gather only the blocks their window touches: 7 positions span <= 3 blocks.
    assert first[0].shape[1] <= 3 < plan.single_tables.shape[1]


@pytest.fixture(scope="module", params=[("serial", True), ("parallel", True),
                                        ("serial", False), ("parallel", False)],
                ids=lambda p: f"{p[0]}-{'native' if p[1] else 'numba'}")
def numba_backend(request) -> NumbaAttentionBackend:
    kernel, use_native = request.param
    return NumbaAttentionBackend(kernel=kernel, use_native=use_native)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [5, 16])
def test_numba_and_native_match_reference_and_skip_what_precedes_windows(
        numba_backend, block_size, window):
    batch = batch_for(block_size, window, seed=block_size + 1, poison=True)
    want = run(ReferenceAttentionBackend(), batch, window)
    got = run(numba_backend, batch, window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_full_attention_is_unchanged_by_a_window_covering_the_context(numba_backend):
    batch = batch_for(16, 0, seed=3)
    full = run(numba_backend, batch, None)
    assert torch.equal(run(numba_backend, batch, 0), full)
    assert torch.equal(run(numba_backend, batch, 51), full)  # > every context: same loops
    assert not torch.allclose(run(numba_backend, batch, 7), full)  # a real window does change it


@pytest.mark.parametrize(("window", "block_size"), [(2500, 16), (600, 16), (2100, 7)])
def test_long_contexts_attend_only_their_window_split_in_parts(numba_backend, window,
                                                               block_size):
    # Windows past the native kernel's 2048-position split: parts start mid-block.
    specs = [(1, 5000), (1, 2600), (1, 300)]
    batch = paged_batch(4, specs, block_size, HQ, HKV, DIM, poison=True)
    poison_before_windows(batch, window)
    want = run(ReferenceAttentionBackend(), batch, window)
    got = run(numba_backend, batch, window)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def fake_flash_varlen(calls: list):
    """flash_attn_varlen_func as its docstring defines it, dense, over the paged cache:
    query i of a sequence attends keys j in [i + sk - sq - left, i + sk - sq + right]
    (a bound of -1: unbounded), and j <= i + sk - sq when causal."""

    def varlen(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
               block_table, window_size=(-1, -1)):
        calls.append(window_size)
        left, right = window_size
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]
        for b in range(len(cu_q) - 1):
            sq, sk = int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
            keys = k_cache[block_table[b]].flatten(0, 1)[:sk].float()  # [sk, Hkv, D]
            values = v_cache[block_table[b]].flatten(0, 1)[:sk].float()
            i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
            keep = (j <= i) if causal else torch.ones(sq, sk, dtype=torch.bool)
            if left >= 0:
                keep &= j >= i - left
            if right >= 0:
                keep &= j <= i + right
            rows = q[int(cu_q[b]) : int(cu_q[b + 1])].float()
            for h in range(q.shape[1]):
                s = (rows[:, h] @ keys[:, h // group].T) * softmax_scale
                w = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
                out[int(cu_q[b]) : int(cu_q[b + 1]), h] = (w @ values[:, h // group]).to(q.dtype)
        return out

    return varlen


@pytest.mark.parametrize("window", [None, 1, 7, 30, 64])
def test_flash_attn_gets_window_size_w_minus_1_and_0(window):
    specs = [(1, 40), (6, 30), (9, 9)]
    q, k, v, k_cache, v_cache, meta = paged_batch(5, specs, 256, HQ, HKV, DIM)
    q, k_cache, v_cache = q.half(), k_cache.half(), v_cache.half()
    calls: list = []
    backend = FlashAttnBackend(fallback=TorchAttentionBackend(),
                               varlen_func=fake_flash_varlen(calls))
    got = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(meta), DIM**-0.5,
                          window=window)
    want = ReferenceAttentionBackend().forward(q, None, None, k_cache, v_cache, meta,
                                               DIM**-0.5, window=window)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
    assert calls == [(window - 1, 0) if window else (-1, -1)]
    assert window_kwargs(0) == {}  # full attention: flash-attn's default, no keyword


def test_flash_attn_passes_the_window_to_its_fallback():
    batch = paged_batch(6, SPECS, 16, HQ, HKV, DIM)  # block 16: no multiple of 256

    def never(*args, **kwargs):
        raise AssertionError("flash-attn was asked for a step it cannot take")

    got = run(FlashAttnBackend(fallback=TorchAttentionBackend(), varlen_func=never), batch, 7)
    torch.testing.assert_close(got, run(ReferenceAttentionBackend(), batch, 7),
                               atol=2e-5, rtol=1e-4)


def test_a_step_prepared_once_serves_windowed_and_full_layers(numba_backend):
    q, k, v, k_cache, v_cache, meta = batch = batch_for(5, 7, seed=8)
    plan = numba_backend.prepare(meta)
    for window in (7, None, 16):
        got = numba_backend.forward(q, k, v, k_cache, v_cache, plan, DIM**-0.5, window=window)
        torch.testing.assert_close(got, run(ReferenceAttentionBackend(), batch, window),
                                   atol=ATOL, rtol=RTOL)

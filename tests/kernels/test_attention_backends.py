"""Every attention backend equals the slow reference on random paged batches."""

from __future__ import annotations

import random
import shutil
import time

import pytest
import torch

from kernels import BACKEND_NAMES, CUDA_ONLY_BACKENDS, DEFAULT_BACKEND, make_backend, native
from kernels.attention import AttentionMetadata
from kernels.numba_backend import NumbaAttentionBackend
from kernels.numba_kernels import paged_decode, paged_decode_serial
from kernels.reference import ReferenceAttentionBackend
from kernels.torch_backend import TorchAttentionBackend

# fp32 kernels against the float64 reference: observed error is ~1e-6 (accumulation order).
ATOL, RTOL = 1e-4, 1e-4


def random_specs(seed: int, block_size: int) -> list[tuple[int, int]]:
    """(query_len, context_len) per sequence: decodes, chunks after a cached prefix, fresh
    prompts and one-token prompts, mixed in one step."""
    rng = random.Random(seed)
    specs = []
    for kind in ["decode", "chunk", "fresh", "decode", "chunk", "decode", "one-token-prompt"]:
        n = {"decode": 1, "one-token-prompt": 1}.get(kind, rng.randint(2, 3 * block_size))
        prefix = 0 if kind in ("fresh", "one-token-prompt") else rng.randint(1, 3 * block_size)
        specs.append((n, prefix + n))
    return specs


def paged_batch(
    seed: int, specs: list[tuple[int, int]], block_size: int, hq: int, hkv: int, dim: int,
    spare_blocks: int = 8, poison: bool = False,
):
    """A step over ``specs`` with block tables drawn at random from a shuffled pool (holes,
    out of order), and a cache holding every K/V. ``poison``: every slot no sequence owns,
    including the tail of partly filled last blocks, holds NaN, so reading one shows."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tables = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = sum(tables) + spare_blocks
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(nb)] for nb in tables]
    query_lens, context_lens = [n for n, _ in specs], [ctx for _, ctx in specs]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    k_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen)
    if poison:
        owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for ctx, table in zip(context_lens, tables, strict=True):
            for p in range(ctx):
                owned[table[p // block_size], p % block_size] = True
        k_cache[~owned] = float("nan")
        v_cache[~owned] = float("nan")
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


def run(backend, batch, scale):
    q, k, v, k_cache, v_cache, meta = batch
    return backend.forward(q, k, v, k_cache, v_cache, backend.prepare(meta), scale)


@pytest.fixture(scope="module", params=[("serial", True), ("parallel", True),
                                        ("serial", False), ("parallel", False)],
                ids=lambda p: f"{p[0]}-{'native' if p[1] else 'numba'}")
def numba_backend(request) -> NumbaAttentionBackend:
    """Every kernel: in the calling thread (small steps) and on the pool's threads, the
    AVX2 one (where it builds) and numba's."""
    kernel, use_native = request.param
    return NumbaAttentionBackend(kernel=kernel, use_native=use_native)


def test_native_kernel_builds_here_and_is_cached():
    # Where a compiler and AVX2 exist (this project's machines), the backend must not
    # silently fall back to numba; a second load reuses the built library.
    if not native._cpu_has_avx2_fma() or shutil.which("g++") is None:
        pytest.skip("no AVX2/FMA or no g++: the numba kernel is the one in use")
    first = native.load()
    assert first is not None and first.supports(64) and not first.supports(60)
    start = time.perf_counter()
    again = native.load()
    assert again.path == first.path and time.perf_counter() - start < 0.5
    assert NumbaAttentionBackend(warm_up=False).native is not None
    assert NumbaAttentionBackend(warm_up=False, use_native=False).native is None


def test_native_kernel_is_off_when_disabled():
    # CONTINUUM_NATIVE_KERNELS=0, as the executor passes it on (executor_svc/settings.py).
    assert native.load(native.NativeOptions(enabled=False)) is None


@pytest.mark.parametrize(
    ("seed", "block_size", "hq", "hkv", "dim"),
    [(0, 16, 9, 3, 64), (1, 4, 9, 3, 64), (2, 8, 4, 4, 32), (3, 1, 8, 2, 16)],
)
def test_torch_backend_matches_reference(seed, block_size, hq, hkv, dim):
    batch = paged_batch(seed, random_specs(seed, block_size), block_size, hq, hkv, dim)
    want = run(ReferenceAttentionBackend(), batch, dim**-0.5)
    got = run(TorchAttentionBackend(), batch, dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("seed", "block_size", "hq", "hkv", "dim"),
    [(0, 16, 9, 3, 64), (1, 4, 9, 3, 64), (2, 8, 4, 4, 32), (3, 1, 8, 2, 16), (4, 16, 6, 6, 64)],
)
def test_numba_backend_matches_reference_on_mixed_steps(numba_backend, seed, block_size, hq,
                                                        hkv, dim):
    batch = paged_batch(seed, random_specs(seed, block_size), block_size, hq, hkv, dim,
                        poison=True)
    want = run(ReferenceAttentionBackend(), batch, dim**-0.5)
    got = run(numba_backend, batch, dim**-0.5)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("seed", "block_size", "hq", "hkv", "dim"),
                         [(0, 16, 9, 3, 64), (1, 4, 9, 3, 64), (3, 1, 8, 2, 16)])
def test_a_16_bit_pool_is_read_in_place_and_matches_reference(seed, block_size, hq, hkv, dim,
                                                             kv_dtype):
    # --kv-cache-dtype: the AVX2 kernel widens float16 / bfloat16 K/V as it reads them.
    if native.load() is None:
        pytest.skip("no native kernels here: 16-bit pools go through the torch backend")
    q, k, v, k_cache, v_cache, meta = paged_batch(seed, random_specs(seed, block_size),
                                                  block_size, hq, hkv, dim, poison=True)
    # This step's K/V as the pool stores them (a whole-prompt chunk attends to its fresh
    # K/V, not the pool's copy: rounded here so that both are the same values).
    k, v = k.to(kv_dtype).float(), v.to(kv_dtype).float()
    narrow = (q, k, v, k_cache.to(kv_dtype), v_cache.to(kv_dtype), meta)
    widened = (q, k, v, narrow[3].float(), narrow[4].float(), meta)  # the values it stores
    want = run(ReferenceAttentionBackend(), widened, dim**-0.5)
    backend = NumbaAttentionBackend(warm_up=False)
    got = run(backend, narrow, dim**-0.5)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)  # NaN-poisoned slots unread


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_native_kv_write_rounds_like_torch(kv_dtype):
    lib = native.load()
    if lib is None:
        pytest.skip("no native kernels here")
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(13, 3, 24, generator=gen) * 100, torch.randn(13, 3, 24, generator=gen)
    k[0, 0, :4] = torch.tensor([float("nan"), float("inf"), 65520.0, 1e-8])  # edges
    k_pool = torch.zeros(8, 4, 3, 24, dtype=kv_dtype)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.randperm(32, generator=gen)[:13]
    lib.kv_write(k, v, k_pool, v_pool, slots)
    want_k = torch.zeros_like(k_pool).view(-1, 3, 24).index_copy_(0, slots, k.to(kv_dtype))
    want_v = torch.zeros_like(v_pool).view(-1, 3, 24).index_copy_(0, slots, v.to(kv_dtype))
    # Bit for bit (any NaN stays a NaN: its payload may differ)
    for got, want in ((k_pool, want_k), (v_pool, want_v)):
        torch.testing.assert_close(got.view(-1, 3, 24), want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize(("block_size", "hq", "hkv"), [(16, 9, 3), (16, 4, 4), (5, 6, 2)])
def test_numba_decodes_match_reference_at_context_lengths_1_to_600(numba_backend, block_size,
                                                                   hq, hkv):
    # Block edges (1, bs - 1, bs, bs + 1), long contexts, and a chunk riding along.
    rng = random.Random(block_size * 100 + hq)
    lengths = [1, 2, block_size - 1, block_size, block_size + 1, 511, 512, 513, 600]
    lengths += [rng.randint(1, 600) for _ in range(6)]
    specs = [(1, ctx) for ctx in lengths if ctx >= 1] + [(37, 300)]
    batch = paged_batch(7, specs, block_size, hq, hkv, 64, poison=True)
    want = run(ReferenceAttentionBackend(), batch, 0.125)
    got = run(numba_backend, batch, 0.125)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [16, 5])
def test_long_contexts_attended_in_parts_match_reference(numba_backend, block_size):
    # Past 2,048 positions the AVX2 kernel splits a sequence into parts on separate threads
    # and merges them by their softmax statistics: part edges, a last part of one position,
    # large scores (the merge must rescale), and short sequences beside them.
    lengths = [2048, 2049, 4096 + 1, 5000, 300, 1]
    batch = paged_batch(11, [(1, ctx) for ctx in lengths] + [(20, 2100)], block_size, 9, 3,
                        64, poison=True)
    batch = (batch[0] * 30, *batch[1:])
    want = run(ReferenceAttentionBackend(), batch, 0.125)
    got = run(numba_backend, batch, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_a_long_sequences_output_does_not_depend_on_the_batch():
    # The split depends on the sequence's own length, not on the step: alone or beside
    # others, in the calling thread or on the pool's, the same bits.
    if native.load() is None:
        pytest.skip("no native kernels here")
    specs = [(1, 100), (1, 4100), (1, 700), (1, 2500)]
    q, k, v, k_cache, v_cache, meta = paged_batch(12, specs, 16, 9, 3, 64)
    together = {}
    for kernel in ("serial", "parallel"):
        backend = NumbaAttentionBackend(kernel=kernel)
        together[kernel] = run(backend, (q, k, v, k_cache, v_cache, meta), 0.125)
    assert torch.equal(together["serial"], together["parallel"])
    for i in (1, 3):
        alone = AttentionMetadata.build([1], [specs[i][1]], [meta.block_tables[i].tolist()], 16)
        got = run(NumbaAttentionBackend(kernel="parallel"),
                  (q[i : i + 1], k[i : i + 1], v[i : i + 1], k_cache, v_cache, alone), 0.125)
        assert torch.equal(got[0], together["parallel"][i])


def test_numba_backend_handles_large_scores_without_overflow(numba_backend):
    # Scores in the thousands: the online softmax must rescale, not exponentiate raw scores.
    batch = paged_batch(5, [(1, 200), (1, 33)], 16, 9, 3, 64)
    q = batch[0] * 300
    batch = (q, *batch[1:])
    want = run(ReferenceAttentionBackend(), batch, 0.125)
    got = run(numba_backend, batch, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_numba_backend_falls_back_to_torch_for_bfloat16(numba_backend):
    q, k, v, k_cache, v_cache, meta = paged_batch(6, random_specs(6, 16), 16, 9, 3, 64)
    batch = tuple(t.bfloat16() for t in (q, k, v, k_cache, v_cache)) + (meta,)
    want = run(TorchAttentionBackend(), batch, 0.125)
    got = run(numba_backend, batch, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_numba_kernels_are_compiled_at_construction():
    backend = NumbaAttentionBackend()
    assert backend.warm_up_s > 0
    assert NumbaAttentionBackend.warm_up() < 1.0  # already compiled: plain calls


def test_numba_backend_picks_threads_only_for_big_steps():
    backend = NumbaAttentionBackend(warm_up=False)
    small = AttentionMetadata.build([1, 1], [100, 200], [[0] * 7, [1] * 13], 16)
    big = AttentionMetadata.build([1] * 16, [600] * 16, [[0] * 38] * 16, 16)
    assert backend.prepare(small).kernel is paged_decode_serial
    want = paged_decode if torch.get_num_threads() > 1 else paged_decode_serial
    assert backend.prepare(big).kernel is want


def test_numba_backend_leaves_torch_thread_count_alone():
    # numba's pool shares torch's OpenMP runtime; starting it must not change --threads.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = NumbaAttentionBackend()
        plan = backend.prepare(AttentionMetadata.build([1] * 16, [600] * 16, [[0] * 38] * 16, 16))
        assert torch.get_num_threads() == 1
        assert plan.kernel is paged_decode_serial  # one thread: no pool
    finally:
        torch.set_num_threads(before)


def test_make_backend_knows_every_name():
    assert DEFAULT_BACKEND in BACKEND_NAMES
    for name in BACKEND_NAMES:
        if name not in CUDA_ONLY_BACKENDS:  # those: tests/kernels/test_triton_backend_choice.py
            assert make_backend(name).forward is not None
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("flash")


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


@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 1001])
def test_native_add_rms_norm_matches_torch(tokens):
    # The fused residual add + RMSNorm the model runs over hidden-major [H, T] activations.
    lib = native.load()
    if lib is None:
        pytest.skip("no native kernels here: the model uses the torch ops")
    gen = torch.Generator().manual_seed(tokens)
    x, delta = torch.randn(576, tokens, generator=gen), torch.randn(576, tokens, generator=gen)
    weight = torch.randn(576, generator=gen)
    want_x = x + delta
    want = weight[:, None] * (want_x * torch.rsqrt(want_x.pow(2).mean(0, keepdim=True) + 1e-5))
    got = lib.add_rms_norm(x, delta, weight, 1e-5)
    torch.testing.assert_close(x, want_x, atol=0, rtol=0)  # the add happened in place
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(lib.add_rms_norm(x.clone(), None, weight, 1e-5), got)
    # From 256 tokens the tokens are split between threads: the same bits as one thread.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone_x = x - delta
        alone = lib.add_rms_norm(alone_x, delta, weight, 1e-5)
    finally:
        torch.set_num_threads(threads)
    split_x = x - delta
    assert torch.equal(lib.add_rms_norm(split_x, delta, weight, 1e-5), alone)
    assert torch.equal(split_x, alone_x)

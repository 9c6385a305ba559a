"""The Triton kernels equal the slow reference, on the CPU through triton's interpreter.

TRITON_INTERPRET=1 must be set before kernels/triton_kernels.py is imported (``triton.jit``
reads it when a kernel is decorated; the first launch imports it) and while the kernels run
(the launchers ask for float32 matmuls under it), so a module fixture sets it and puts the
old value back after the last test: another module's teardown may have removed it. The
interpreter runs every tile as numpy operations: shapes stay small (the file takes ~20 s of
CPU, imports included; minutes of wall time when the shared machine is loaded).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

# Before triton itself is imported, too: with the switch set only after that, the
# interpreted kernels failed here calling their @triton.jit helpers.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (the test extra pins it)")

from kernels import triton_attention  # noqa: E402
from kernels.attention import AttentionMetadata, window_start  # noqa: E402
from kernels.reference import ReferenceAttentionBackend  # noqa: E402
from kernels.triton_attention import TritonAttentionBackend, kv_write  # noqa: E402

# Against the float64 reference: fp32 pools see ~1e-6; a 16-bit pool rounds K/V the same for
# both (the reference reads the cache), leaving the 16-bit P @ V and output rounding.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3),
             torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    os.environ.pop("TRITON_INTERPRET", None)  # what other modules' processes should inherit


def paged_step(seed, specs, block_size, hq, hkv, dim, dtype, q_dtype=None):
    """A step over ``specs`` ((query_len, context_len) per sequence) whose block tables are
    drawn from a shuffled pool with spare blocks (holes, out of order). Every slot no
    sequence owns, the tails of partial last blocks included, holds NaN: reading one shows."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = sum(counts) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(nb)] for nb in counts]
    meta = AttentionMetadata.build([n for n, _ in specs], [c for _, c in specs], tables,
                                   block_size)
    shape = (num_blocks, block_size, hkv, dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for (_, ctx), table in zip(specs, tables, strict=True):
        for p in range(ctx):
            k_cache[table[p // block_size], p % block_size] = torch.randn(hkv, dim, generator=gen)
            v_cache[table[p // block_size], p % block_size] = torch.randn(hkv, dim, generator=gen)
    q = torch.randn(sum(n for n, _ in specs), hq, dim, generator=gen).to(q_dtype or dtype)
    return q, k_cache, v_cache, meta


def check(backend, step, dtype, window=None):
    q, k_cache, v_cache, meta = step
    scale = q.shape[-1] ** -0.5
    # The reference reads only the cache; k/v are not used by either backend.
    want = ReferenceAttentionBackend().forward(q, None, None, k_cache, v_cache, meta, scale,
                                               window=window)
    got = backend.forward(q, None, None, k_cache, v_cache, backend.prepare(meta), scale,
                          window=window)
    assert got.dtype == q.dtype and not got.isnan().any()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def random_specs(seed: int, block_size: int, count: int) -> list[tuple[int, int]]:
    """Decodes, chunks after a cached prefix and fresh prompts, mixed, with random lengths."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        n = 1 if i % 2 == 0 else rng.randint(2, 20)
        prefix = 0 if i % 4 == 3 else rng.randint(0, 3 * block_size)
        specs.append((n, prefix + n))
    return specs


@pytest.mark.parametrize(
    ("seed", "block_size", "hq", "hkv", "dim", "dtype"),
    [(0, 16, 9, 3, 64, torch.float32),  # the bundled model's shape
     (1, 5, 8, 2, 32, torch.float16),  # a block size no power of two, GQA 4
     (2, 8, 4, 4, 16, torch.bfloat16),  # no GQA, head dim at tl.dot's minimum
     (3, 3, 6, 1, 24, torch.float32)],  # MQA, head dim padded to 32
)
def test_mixed_steps_match_reference(seed, block_size, hq, hkv, dim, dtype):
    step = paged_step(seed, random_specs(seed, block_size, 5), block_size, hq, hkv, dim, dtype)
    check(TritonAttentionBackend(block_n=16, block_m=16), step, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_split_k_decode_over_long_contexts_matches_reference(dtype):
    # Each row cuts its context into 3 tile-aligned splits: 100 -> 48 + 48 + 4; 60 -> 32 +
    # 28 + nothing; 7 -> 7 + nothing + nothing; 33 -> 16 + 16 + 1.
    specs = [(1, 100), (1, 7), (1, 60), (1, 33)]
    step = paged_step(10, specs, 16, 4, 2, 16, dtype)
    check(TritonAttentionBackend(num_splits=3, block_n=16), step, dtype)


@pytest.mark.parametrize(("window", "block_size", "splits", "dtype"), [
    (7, 5, None, torch.float32),  # a window no multiple of the block or the tile
    (16, 16, 3, torch.float16),  # split-K over a window that starts mid-context
    (23, 3, 2, torch.float32),  # equal to one decode's context, block size 3
    (64, 8, None, torch.bfloat16),  # wider than every context: full attention's values
])
def test_sliding_windows_match_reference_and_skip_what_precedes_them(window, block_size,
                                                                     splits, dtype):
    # Decodes past and inside the window, a chunk starting past it (chunked prefill), one
    # straddling it, a fresh prompt longer than it. Every position before a sequence's
    # first window start holds NaN: the tiles start at the windows, so none is read.
    specs = [(1, 50), (1, 4), (5, 35), (12, 15), (25, 25), (1, 23)]
    q, k_cache, v_cache, meta = step = paged_step(12, specs, block_size, 4, 2, 16, dtype)
    for i, (n, ctx) in enumerate(specs):
        for p in range(window_start(ctx - n, window)):
            k_cache[meta.block_tables[i, p // block_size], p % block_size] = float("nan")
            v_cache[meta.block_tables[i, p // block_size], p % block_size] = float("nan")
    check(TritonAttentionBackend(num_splits=splits, block_n=16, block_m=16), step, dtype,
          window=window)


def test_float32_model_over_a_16_bit_pool_matches_reference():
    # --kv-cache-dtype float16 with a float32 model: q and the output stay float32.
    step = paged_step(11, [(1, 40), (12, 30)], 8, 4, 2, 16, torch.float16, q_dtype=torch.float32)
    check(TritonAttentionBackend(num_splits=2, block_n=16, block_m=16), step, torch.float16)


def test_choose_splits_fills_the_device_and_respects_the_floor():
    assert triton_attention.choose_splits(1, 8, 100, "cpu") == 1  # short: one split
    assert triton_attention.choose_splits(1, 1, 100_000, "cpu") == 16  # 16 programs wanted
    assert triton_attention.choose_splits(64, 8, 100_000, "cpu") == 1  # batch fills it


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_write_by_slot_mapping(dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, hkv, dim = 6, 4, 3, 8
    k_cache = torch.zeros(num_blocks, block_size, hkv, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([21, 2, -1, 9, 14], dtype=torch.int64)  # out of order, one padding
    k = torch.randn(5, hkv, dim, generator=gen)  # a float32 model: rounded into the pool
    v = torch.randn(5, hkv, dim, generator=gen)
    kv_write(k, v, k_cache, v_cache, slots)
    want_k = torch.zeros_like(k_cache).view(-1, hkv, dim)
    want_v = torch.zeros_like(v_cache).view(-1, hkv, dim)
    live = slots >= 0
    want_k[slots[live]] = k[live].to(dtype)
    want_v[slots[live]] = v[live].to(dtype)
    # The interpreter truncates to bfloat16 where the GPU rounds: one ulp apart at most.
    atol = 1e-2 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(k_cache.view(-1, hkv, dim), want_k, atol=atol, rtol=atol)
    torch.testing.assert_close(v_cache.view(-1, hkv, dim), want_v, atol=atol, rtol=atol)


def test_triton_is_unavailable_on_the_cpu_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_attention.available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_attention.available("cpu")


def test_gpu_check_entry_point_runs_its_quick_mode_here(capsys):
    # scripts/gpu_check.sh runs `python -m kernels.triton_check` on CUDA; this keeps it from
    # rotting where no GPU is: the same code, one tiny case per dtype, in the interpreter.
    from kernels import triton_check

    assert triton_check.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "all triton attention checks passed" in out and "MISS" not in out


def test_the_models_forward_through_triton_matches_transformers(tmp_path):
    # The backend inside DecoderModel.forward: a 2-layer GQA model's prefill in two chunks over
    # shuffled blocks, then a decode, each against transformers' logits (tests/executor).
    transformers = pytest.importorskip("transformers")
    from executor_svc.models.decoder import DecoderModel
    from tests.executor.test_model import ROPE, _check_three_steps

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, rope_parameters=ROPE)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    _check_three_steps(DecoderModel.load(tmp_path), hf, TritonAttentionBackend(), torch.float32,
                       tol=1e-4)

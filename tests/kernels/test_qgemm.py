"""kernels/cpu_qgemm.cpp through kernels/quant.py: per GGUF format, random blocks ->
every dequantized weight EQUAL to gguf.quants.dequantize (what transformers loads), and the
GEMM (narrow decode kernel, N <= 8, and the panel path, N > 8) against dequantize-then-fp32
matmul, and bit for bit against its documented summation order (AVX2); the AVX-512 build
compiles on any machine and agrees with AVX2 where the CPU runs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kernels import native, quant

LIB = native.load()
pytestmark = pytest.mark.skipif(LIB is None, reason="no AVX2 CPU or compiler: no native kernels")

# Offsets of each format's fp16 scale fields within a block (kept finite and small).
_HALVES = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 14: (208,), 1: (), 30: ()}
# fp32 sums of 512-1024 products of O(1) values in another order: ~1e-5 relative.
TOL = 2e-4


def random_tensor(fmt: int, rows: int, cols: int, seed: int = 0) -> quant.RawTensor:
    rng = np.random.default_rng(seed)
    _, block, size = quant.FORMATS[fmt]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in _HALVES[fmt]:
        data[:, :, off:off + 2] = rng.normal(0, 0.05, (rows, cols // block, 1)).astype(
            np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    if fmt == 1:  # F16: values, not bit noise (no inf / nan)
        data = rng.normal(0, 1, (rows, cols)).astype(np.float16).view(np.uint8)
    if fmt == 30:
        data = torch.randn(rows, cols).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    return quant.RawTensor(fmt, (rows, cols), data.reshape(rows, -1))


def reference(t: quant.RawTensor) -> np.ndarray:
    return dequantize(t.data, GGMLQuantizationType(t.format)).astype(np.float32)


FORMATS = [2, 3, 8, 12, 14, 1, 30]
IDS = [quant.FORMATS[f][0] for f in FORMATS]


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantized_values_equal_gguf_and_the_gemm_matches(fmt):
    t = random_tensor(fmt, 13, 512, seed=fmt)
    w = quant.QuantWeight(LIB, [t])
    want = reference(t)
    assert np.array_equal(w.dequantize().numpy(), want), "a weight value differs from gguf's"
    ref = torch.from_numpy(want).double()
    for n in (1, 3, 4, 6, 8, 9, 21):
        x = torch.randn(512, n)
        got = w.mm(x)
        expect = (ref @ x.double()).float()
        torch.testing.assert_close(got, expect, rtol=TOL, atol=TOL * expect.abs().max().item())
    xt = torch.randn(7, 512)  # a transposed token-major view, and token-major output
    torch.testing.assert_close(w.mm_t(xt.t()), (ref @ xt.t().double()).t().float(),
                               rtol=TOL, atol=TOL * 30)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_a_wide_copy_gives_the_blocks_bits_and_serves_only_wide_gemms(fmt):
    """The hybrid format's fp32 copy: GEMMs over more than 8 columns read it, and give the
    blocks' bits (same values, same summation order); 8 columns or fewer read the blocks."""
    parts = [random_tensor(fmt, 37, 512, seed=fmt), random_tensor(fmt, 11, 512, seed=9)]
    blocks, hybrid = quant.QuantWeight(LIB, parts), quant.QuantWeight(LIB, parts)
    assert hybrid.add_wide_copy() and hybrid.wide_nbytes >= 48 * 512 * 4
    for n in (1, 8, 9, 16, 33, 130):
        x = torch.randn(512, n)
        assert torch.equal(blocks.mm(x), hybrid.mm(x)), n
        xt = torch.randn(n, 512)
        assert torch.equal(blocks.mm_t(xt.t()), hybrid.mm_t(xt.t())), n
    hybrid._wide._keep[0].mul_(2)  # a different copy shows which one a call read
    x = torch.randn(512, 9)
    assert torch.equal(hybrid.mm(x), 2 * blocks.mm(x))
    assert torch.equal(hybrid.mm(x[:, :8]), blocks.mm(x[:, :8]))
    fp32 = quant.QuantWeight(LIB, [quant.RawTensor(0, (6, 512), np.ones((6, 512), np.float32))])
    assert not fp32.add_wide_copy() and fp32.wide_nbytes == 0  # packed fp32 already


def test_mixed_segments_and_the_embedding_lookup():
    # q/k/v fused across formats (Q4_K_M keeps attn_v in Q6_K), a 130-column prefill chunk.
    # Neighbours in one format merge into one segment.
    parts = [random_tensor(12, 8, 256, 1), random_tensor(12, 3, 256, 4),
             random_tensor(14, 2, 256, 2), random_tensor(8, 9, 256, 3)]
    w = quant.QuantWeight(LIB, parts)
    want = np.concatenate([reference(p) for p in parts])
    assert w.shape == (22, 256) and w.formats == ("Q4_K", "Q6_K", "Q8_0")
    assert np.array_equal(w.dequantize().numpy(), want)
    x = torch.randn(256, 130)
    torch.testing.assert_close(w.mm(x), torch.from_numpy(want) @ x, rtol=TOL, atol=TOL * 20)
    ids = torch.tensor([21, 0, 9, 9])
    assert torch.equal(w.rows(ids), torch.from_numpy(want)[ids])
    with pytest.raises(IndexError, match="outside the vocabulary"):
        w.rows(torch.tensor([22]))
    with pytest.raises(ValueError, match="readable"):
        quant.QuantWeight(LIB, [random_tensor(3, 4, 64), random_tensor(3, 4, 96)])


def test_a_fp32_segment_goes_through_the_packed_gemm():
    dense = torch.randn(7, 64)
    w = quant.QuantWeight(LIB, [random_tensor(2, 6, 64), quant.RawTensor(0, (7, 64),
                                                                          dense.numpy())])
    x = torch.randn(64, 3)
    want = torch.cat([torch.from_numpy(reference(random_tensor(2, 6, 64))), dense]) @ x
    torch.testing.assert_close(w.mm(x), want, rtol=TOL, atol=TOL * 10)


def test_isa_choice_never_picks_what_the_cpu_lacks():
    avx2 = native.ISA_CPU_FLAGS["avx2"]
    assert native.choose_isa("auto", avx2) == "avx2"
    assert native.choose_isa("avx512", avx2) == "avx2"  # logged, falls back
    assert native.choose_isa("auto", native.ISA_CPU_FLAGS["avx512"]) == "avx512"
    assert native.choose_isa("avx2", native.ISA_CPU_FLAGS["avx512"]) == "avx2"
    assert native.choose_isa("auto", {"sse2"}) is None
    with pytest.raises(ValueError, match="unknown ISA"):
        native.choose_isa("avx9", avx2)


def test_the_avx512_build_compiles_and_agrees_with_avx2_where_it_runs(tmp_path):
    # Its AVX-512 paths (cpu_qgemm.cpp) compile on any x86-64 with g++; the whole library is
    # built where it can run.
    assert native.compile_check("avx512", tmp_path).stat().st_size > 0
    if native.choose_isa("auto", native.cpu_flags()) != "avx512":
        pytest.skip("this CPU lacks AVX-512 F/BW/VL/DQ: the build compiles, it cannot run here")
    fast = native.load(native.NativeOptions(isa="avx512"))
    slow = native.load(native.NativeOptions(isa="avx2"))
    assert (fast.isa, slow.isa) == ("avx512", "avx2")
    for fmt in (3, 8, 12):
        t = random_tensor(fmt, 30, 1024, seed=fmt)
        a, b = quant.QuantWeight(fast, [t]), quant.QuantWeight(slow, [t])
        assert torch.equal(a.dequantize(), b.dequantize())
        for n in (1, 4, 40):
            x = torch.randn(1024, n)
            want = b.mm(x)
            torch.testing.assert_close(a.mm(x), want, rtol=TOL, atol=TOL * want.abs().max())


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fused multiply-add, exactly rounded: a * b is exact in float64 (48 bits), the sum
    p + c splits into s + e (TwoSum, exact), and s rounds to float32 as the exact value does
    unless it is a float32 midpoint, where the sign of e decides."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    bp = s - c
    e = (p - bp) + (c - (s - bp))
    f = s.astype(np.float32)
    lo = np.where(f.astype(np.float64) > s, np.nextafter(f, np.float32(-np.inf)), f)
    hi = np.nextafter(lo, np.float32(np.inf))
    tie = (lo.astype(np.float64) + hi.astype(np.float64)) / 2 == s
    return np.where(tie & (e > 0), hi, np.where(tie & (e < 0), lo, f))


def _lane_sums(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The AVX2 narrow kernel's order (N <= 8): per output, accumulator a sums the 8-lane
    chunks j = a (mod A) lane by lane (A = 2 for N <= 4, else 1), then the A sums are added
    and the 8 lanes reduced as hsum does: (l + l+4), then (l + l+2), then lane 0 + lane 1."""
    m, k = w.shape
    n = x.shape[1]
    accs = 2 if n <= 4 else 1
    wc = w.reshape(m, 1, k // 8, 8)
    xc = x.T.reshape(1, n, k // 8, 8)
    acc = [np.zeros((m, n, 8), np.float32) for _ in range(accs)]
    for j in range(k // 8):
        acc[j % accs] = _fma32(wc[:, :, j], xc[:, :, j], acc[j % accs])
    v = acc[0] + acc[1] if accs == 2 else acc[0]
    v = v[..., :4] + v[..., 4:]
    v = v[..., :2] + v[..., 2:]
    return v[..., 0] + v[..., 1]


def _sequential_sums(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The 6 x 16 tile's order (N > 8): one FMA chain over k per output, from zero."""
    acc = np.zeros((w.shape[0], x.shape[1]), np.float32)
    for j in range(w.shape[1]):
        acc = _fma32(w[:, j:j + 1], x[j:j + 1, :], acc)
    return acc


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_every_output_is_the_documented_fp32_sum_bit_for_bit(fmt):
    # The summation order is a contract, not a detail: greedy output stays token-exact only
    # while every C[m, n] keeps its bits, so a faster kernel must keep this order (AVX2's;
    # the AVX-512 build sums 16 lanes and agrees within TOL).
    lib = native.load(native.NativeOptions(isa="avx2"))
    t = random_tensor(fmt, 7, 256, seed=fmt + 40)
    w = quant.QuantWeight(lib, [t])
    dense = reference(t)
    rng = np.random.default_rng(fmt)
    for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32):
        x = rng.standard_normal((256, n)).astype(np.float32)
        want = _lane_sums(dense, x) if n <= 8 else _sequential_sums(dense, x)
        got = w.mm(torch.from_numpy(x)).numpy()
        assert np.array_equal(got, want), f"N={n}: {np.abs(got - want).max()}"
        assert np.array_equal(w.mm_t(torch.from_numpy(x)).numpy(), want.T)

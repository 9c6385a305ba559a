"""kernels/cpu_qgemm.cpp through kernels/quant.py: per GGUF format, random blocks ->
every dequantized weight EQUAL to gguf.quants.dequantize (what transformers loads), and the
GEMM (narrow decode kernel, N <= 4, and the panel path, N > 4) against dequantize-then-fp32
matmul; the AVX-512 build compiles on any machine and agrees with AVX2 where the CPU runs it."""

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

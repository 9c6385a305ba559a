"""The native GEMM over packed weights (kernels/cpu_gemm.cpp), the fused RoPE + q/k/v
layout (rope_qkv_f32) and SwiGLU (silu_mul_f32), against torch on the shapes a step
produces and on the edges."""

import pytest
import torch
import torch.nn.functional as F

from executor_svc.models.ops import apply_rope
from kernels import native


@pytest.fixture(scope="module")
def lib():
    loaded = native.load()
    if loaded is None:
        pytest.skip("no native kernels here (no g++ / AVX2): the model keeps torch's matmuls")
    return loaded


# (M, K, N): a decode step's layer shapes, the LM head, and every kind of edge: rows not a
# multiple of the 6-row panel, columns not a multiple of the 16-column tile, one column,
# more columns than one 128-column chunk.
SHAPES = [(960, 576, 64), (3072, 576, 64), (576, 1536, 64), (49152 // 8, 576, 3), (7, 5, 1),
          (13, 33, 17), (6, 8, 16), (577, 100, 130), (11, 64, 300), (1, 1, 1)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_gemm_matches_float64(lib, m, k, n, threads):
    torch.manual_seed(m * 7 + n)
    w, x = torch.randn(m, k), torch.randn(k, n)
    ref = w.double() @ x.double()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = lib.pack_weight(w)
        hidden_major = packed.mm(x)  # [M, N]
        token_major = packed.mm_t(x)  # [N, M]
        from_view = packed.mm(x.t().contiguous().t())  # a transposed token-major tensor
    finally:
        torch.set_num_threads(before)
    # fp32 sums of k products of N(0,1) values: error grows like sqrt(k) * eps * |terms|
    tol = 4e-6 * k
    for got in (hidden_major, token_major.t(), from_view):
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert (got.double() - ref).abs().max().item() < tol
    assert token_major.is_contiguous() and hidden_major.is_contiguous()
    # every path sums in the same order: bit-identical to each other
    assert torch.equal(hidden_major, token_major.t()) and torch.equal(hidden_major, from_view)


def test_packed_weight_keeps_shape_and_refuses_wrong_input(lib):
    packed = lib.pack_weight(torch.randn(10, 4))
    assert packed.shape == (10, 4) and packed.numel() == 40
    assert packed.mm(torch.zeros(4, 0)).shape == (10, 0)
    with pytest.raises(ValueError, match=r"x \[4, N\]"):
        packed.mm(torch.randn(5, 3))
    with pytest.raises(ValueError, match="float32"):
        packed.mm(torch.randn(4, 3, dtype=torch.float64))


# 300 and 1,001 tokens: the prefill sizes whose 8-token groups are split between threads.
@pytest.mark.parametrize("hq,hkv,dim,tokens", [(9, 3, 64, 64), (9, 3, 64, 13), (4, 2, 8, 1),
                                               (32, 8, 128, 70), (2, 1, 16, 8),
                                               (9, 3, 64, 300), (9, 3, 64, 1001)])
def test_rope_qkv_is_bit_identical_to_the_torch_ops(lib, hq, hkv, dim, tokens):
    torch.manual_seed(tokens)
    qkv = torch.randn((hq + 2 * hkv) * dim, tokens)
    positions = torch.randint(0, 8192, (tokens,)).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = inv_freq[:, None] * positions[None, :]
    emb = torch.cat((freqs, freqs))
    cos, sin = emb.cos(), emb.sin()  # [D, T]
    n_qk = (hq + hkv) * dim
    rows = torch.empty(tokens, (hq + 2 * hkv) * dim)
    apply_rope(qkv[:n_qk].view(hq + hkv, dim, tokens), cos, sin,
               out=rows.t()[:n_qk].view(hq + hkv, dim, tokens))
    rows.t()[n_qk:].copy_(qkv[n_qk:])
    q, k, v = lib.rope_qkv(qkv, cos, sin, hq, hkv)
    assert torch.equal(q, rows[:, : hq * dim].view(tokens, hq, dim))
    assert torch.equal(k, rows[:, hq * dim : n_qk].view(tokens, hkv, dim))
    assert torch.equal(v, rows[:, n_qk:].view(tokens, hkv, dim))


@pytest.mark.parametrize("n", [1536 * 64, 8, 7, 1, 20_003])
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_mul_matches_torch(lib, n, threads):
    torch.manual_seed(n)
    gate, up = torch.randn(n) * 6, torch.randn(n)
    gate[:4] = torch.tensor([0.0, -0.0, 100.0, -100.0])[: min(4, n)]  # exp's clamp, both signs
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = lib.silu_mul(gate, up)
    finally:
        torch.set_num_threads(before)
    want = F.silu(gate.double()) * up.double()
    assert got.shape == gate.shape and got.dtype == torch.float32
    # float32 rounding of the SiLU and the product: a few ulp of the result
    assert ((got.double() - want).abs() <= 4e-7 * want.abs() + 1e-30).all()
    assert torch.equal(gate[:2], torch.tensor([0.0, -0.0])[: min(2, n)])  # inputs untouched


def test_silu_mul_propagates_nan_and_infinity(lib):
    gate = torch.tensor([float("nan"), float("inf"), 1.0] * 3)
    up = torch.tensor([1.0, 2.0, float("nan")] * 3)
    got = lib.silu_mul(gate, up)
    want = F.silu(gate) * up
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_the_fma_peak_probe_reports_a_rate_per_thread_count(lib):
    # bench_executor's compute ceiling (a rate, so only its form is checked here, not its size)
    assert lib.fma_peak_gflops(1, rounds=0) == 0.0
    for threads in (1, 2):
        rate = lib.fma_peak_gflops(threads, rounds=200_000)
        assert rate > 0.0 and rate == rate and rate != float("inf")

"""The native decoder (kernels/cpu_decoder.cpp) runs each layer under its own sliding window:
its one call equals the same kernels called layer by layer from Python, with each layer's
window passed to the attention backend (decode rows through the AVX2 kernel, chunks through
SDPA), on a step that mixes decodes past and inside the windows with prefill chunks."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.attention import AttentionMetadata
from kernels.native_decoder import NativeDecoder
from kernels.numba_backend import NumbaAttentionBackend

HIDDEN, INTER, HQ, HKV, DIM, EPS = 32, 48, 4, 2, 16, 1e-5
BLOCK = 4
SPECS = [(1, 30), (1, 6), (5, 26), (9, 9), (1, 13)]  # (query_len, context_len)


@pytest.fixture(scope="module")
def lib():
    loaded = native.load()
    if loaded is None:
        pytest.skip("no native kernels here (no g++ / AVX2)")
    return loaded


def _weights(lib, num_layers: int, gen: torch.Generator):
    def w(rows, cols):
        return torch.randn(rows, cols, generator=gen) * cols**-0.5

    return [(torch.rand(HIDDEN, generator=gen) + 0.5,
             lib.pack_weight(w((HQ + 2 * HKV) * DIM, HIDDEN)),
             lib.pack_weight(w(HIDDEN, HQ * DIM)),
             torch.rand(HIDDEN, generator=gen) + 0.5,
             lib.pack_weight(w(2 * INTER, HIDDEN)),
             lib.pack_weight(w(HIDDEN, INTER))) for _ in range(num_layers)]


def _step(num_layers: int, gen: torch.Generator):
    """meta, slots [T], a pool [layers, 2, N, BLOCK, Hkv, D] whose cached prefixes hold
    random K/V, x [H, T], cos / sin [D, T]."""
    counts = [-(-ctx // BLOCK) for _, ctx in SPECS]
    order = torch.randperm(sum(counts) + 3, generator=gen).tolist()
    tables, at = [], 0
    for c in counts:
        tables.append(order[at : at + c])
        at += c
    meta = AttentionMetadata.build([n for n, _ in SPECS], [c for _, c in SPECS], tables, BLOCK)
    slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK
                          for (n, ctx), t in zip(SPECS, tables, strict=True)
                          for p in range(ctx - n, ctx)])
    pool = torch.randn(num_layers, 2, len(order), BLOCK, HKV, DIM, generator=gen)
    tokens = len(slots)
    angles = torch.rand(DIM, tokens, generator=gen) * 6.0
    x = torch.randn(HIDDEN, tokens, generator=gen)
    return meta, slots, pool, x, angles.cos().contiguous(), angles.sin().contiguous()


def _per_op(lib, layers, windows, backend, prepared, x, cos, sin, slots, pool):
    """cpu_decoder.cpp's layer loop, op by op through the same kernels."""
    ffn, scale = None, DIM**-0.5
    for (attn_norm, wqkv, wo, ffn_norm, w13, w2), window, i in zip(
            layers, windows, range(len(layers)), strict=True):
        h = lib.add_rms_norm(x, ffn, attn_norm, EPS)
        q, k, v = lib.rope_qkv(wqkv.mm(h), cos, sin, HQ, HKV)
        k_cache, v_cache = pool[i, 0], pool[i, 1]
        lib.kv_write(k, v, k_cache, v_cache, slots)
        o = backend.forward(q, k, v, k_cache, v_cache, prepared, scale, window=window)
        h = lib.add_rms_norm(x, wo.mm(o.view(len(slots), HQ * DIM).t()), ffn_norm, EPS)
        gate_up = w13.mm(h)
        ffn = w2.mm(lib.silu_mul(gate_up[:INTER].contiguous(), gate_up[INTER:].contiguous()))
    return x + ffn


def decoder_step(lib, windows) -> tuple[torch.Tensor, torch.Tensor]:
    """(the native decoder's output, the per-op loop's) for one step under ``windows``."""
    gen = torch.Generator().manual_seed(0)
    layers = _weights(lib, len(windows), gen)
    meta, slots, pool, x, cos, sin = _step(len(windows), gen)
    backend = NumbaAttentionBackend(kernel="serial", warm_up=False)
    prepared = backend.prepare(meta)
    plan = backend.native_plan(prepared, pool, DIM)
    assert plan is not None and plan[4]  # the AVX2 kernel serves it, chunks included
    decoder = NativeDecoder(lib, layers, HIDDEN, INTER, HQ, HKV, DIM, EPS, DIM**-0.5,
                            windows=windows)
    fused_x, fused_pool = x.clone(), pool.clone()
    decoder(fused_x, cos, sin, slots, fused_pool, *plan)
    per_op_pool = pool.clone()
    per_op = _per_op(lib, layers, windows, backend, prepared, x.clone(), cos, sin, slots,
                     per_op_pool)
    torch.testing.assert_close(fused_pool, per_op_pool)  # the same K/V written
    return fused_x, per_op


def test_each_layer_runs_under_its_own_window(lib):
    windows = (5, 0, 9)  # a local layer, a global one, another local one
    fused, per_op = decoder_step(lib, windows)
    torch.testing.assert_close(fused, per_op, atol=1e-5, rtol=1e-5)
    full, full_per_op = decoder_step(lib, (0, 0, 0))
    torch.testing.assert_close(full, full_per_op, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fused, full, atol=1e-3)  # the windows did change the output


def test_windows_must_match_the_layers(lib):
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="2 windows for 3 layers"):
        NativeDecoder(lib, _weights(lib, 3, gen), HIDDEN, INTER, HQ, HKV, DIM, EPS, 0.25,
                      windows=(4, 0))
    decoder = NativeDecoder(lib, _weights(lib, 2, gen), HIDDEN, INTER, HQ, HKV, DIM, EPS, 0.25)
    assert decoder.windows == (0, 0)  # no windows: every layer full

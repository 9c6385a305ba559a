"""The math every architecture's forward pass shares (executor_svc/models/decoder.py):
RMSNorm, RoPE frequencies and rotation, and the projections over hidden-major [H, T]
activations. Each follows transformers op for op (RMSNorm in fp32, rotate-half RoPE), so
greedy outputs match it token for token."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from executor_svc.model_config import ModelConfig
from kernels import native, quant


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dim: int = -1) -> torch.Tensor:
    # As transformers' RMSNorm: normalize in fp32, scale in the input dtype. ``dim``: the
    # normalized axis (0 for hidden-major [H, T] activations, 1 for heads [N, D, T]; ``weight``
    # is then broadcast [H, 1] / [D, 1]).
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim, keepdim=True) + eps)
    return (weight if dim == -1 else weight[:, None]) * x.to(dtype)


def rope_inv_freq(config: ModelConfig, theta: float | None = None) -> torch.Tensor:  # [D / 2]
    """RoPE's frequencies for base ``theta`` (default: rope_theta); rope_scaling applies to
    rope_theta's only (Gemma 3 scales its global layers', not its local ones')."""
    dim = config.head_dim
    base = config.rope_theta if theta is None else theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if config.rope_scaling is None or base != config.rope_theta:
        return inv_freq
    # Llama 3.1 "llama3" scaling: stretch low frequencies, keep high ones, blend between.
    s = config.rope_scaling
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    low_wavelen = old_len / s.get("low_freq_factor", 1.0)
    high_wavelen = old_len / s.get("high_freq_factor", 4.0)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - s.get("low_freq_factor", 1.0)) / (
        s.get("high_freq_factor", 4.0) - s.get("low_freq_factor", 1.0)
    )
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


# A projection [out, in]: a tensor, packed fp32 or GGUF blocks (executor_svc/weight_formats.py).
Weight = torch.Tensor | native.PackedWeight | quant.QuantWeight

_MM_MAX_ROWS = 128
# Output columns per piece of a wide ``linear`` (the LM head): [2048, 64] fp32 = 512 KiB,
# so each piece is transposed while it is still in the core's L2.
_MM_CHUNK = 2048


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ w[out, in].T -> [T, out], contiguous.

    On the 2-core AVX2 CPU, MKL runs w @ x.T 1.2-2x faster than F.linear's x @ w.T for
    2..64 rows (the LM head: 22 vs 37 ms at 16 rows); one row stays a plain GEMV, and past
    ~128 rows the two tie, so the transposing copy is not worth it. The result must be
    contiguous: a head_dim that is not unit-stride sends SDPA down its math path (3x
    slower) and slows every elementwise op after it. A wide ``w`` (the LM head) goes in
    pieces of _MM_CHUNK rows: transposing the whole [V, T] result at once reads it back from
    memory (batch 64: 58-75 -> 43-48 ms on 2 idle cores; the same values, bit for bit).
    Off the CPU none of this applies: F.linear, as transformers' LM head.
    """
    rows, width = x.shape[0], w.shape[0]
    if not 1 < rows <= _MM_MAX_ROWS or x.device.type != "cpu":
        return F.linear(x, w)
    if rows < 16 or width < 4 * _MM_CHUNK:
        return torch.mm(w, x.t()).t().contiguous()
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)  # [T, out]
    for start in range(0, width, _MM_CHUNK):
        out[:, start : start + _MM_CHUNK] = torch.mm(w[start : start + _MM_CHUNK], x.t()).t()
    return out


def project(w: Weight, x: torch.Tensor) -> torch.Tensor:
    """w [out, in] @ x [in, T] -> [out, T], contiguous: a layer's projection, hidden-major.

    ``w`` is a tensor (MKL: w @ x.T is its fast case on these CPUs, and hidden-major output
    needs no transposing copy) or, for fp32 on an AVX2 CPU, a weight packed for the native
    GEMM (kernels/cpu_gemm.cpp, 1.1-1.7x MKL at decode batch sizes). ``x`` may be a
    transposed view of a token-major tensor: both read it in place.
    """
    return w.mm(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    # out = x * cos + rotate_half(x) * sin (HF's rotate-half layout, not llama.cpp's
    # interleaved one). x [N, D, T] hidden-major heads, cos/sin [D, T], out [N, D, T] (any
    # strides: here a view into token-major rows). rotate_half(x) = (-x2, x1).
    half = x.shape[1] // 2
    torch.mul(x, cos, out=out)
    out[:, :half] -= x[:, half:] * sin[:half]
    out[:, half:] += x[:, :half] * sin[half:]

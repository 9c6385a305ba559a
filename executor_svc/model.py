"""A Llama-family forward pass over a flattened (varlen) batch with a paged KV cache.

gpt-fast style: weights as plain tensors, q/k/v fused into one matmul and gate/up into
another, shapes in comments. T = tokens this step (all sequences, concatenated), S = rows
that sample. Between layers the activations are hidden-major, [H, T]: each projection is
then ``W @ x`` with no transposing copy (see ``project``), and only q/k/v are turned into
the token-major [T, heads, D] rows that the attention backends and the KV cache take. The
math follows transformers' LlamaForCausalLM op for op (RMSNorm in fp32, rotate-half RoPE)
so greedy outputs match it token for token.

Tensor parallelism (executor_svc/tp_shard.py, tp_comm.py): a rank holds a slice of the
heads, of the FFN and of the vocabulary, and ``tp`` supplies the collectives that join the
slices. With ``tp`` None (tp_size 1) the forward makes no collective call and no extra copy.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from executor_svc.kv_cache import KVCache
from executor_svc.model_config import ModelConfig
from executor_svc.tp_shard import load_shard
from executor_svc.weight_formats import embedding, fuse, prepare, read_native, resolve
from kernels import native, quant
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.native_decoder import NativeDecoder

if TYPE_CHECKING:
    from executor_svc.tp_comm import TPComm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dim: int = -1) -> torch.Tensor:
    # As LlamaRMSNorm: normalize in fp32, scale in the input dtype. ``dim``: the hidden
    # axis (0 for hidden-major [H, T] activations; ``weight`` [H] is then broadcast [H, 1]).
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim, keepdim=True) + eps)
    return (weight if dim == -1 else weight[:, None]) * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [D / 2]
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is None:
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


class LlamaModel:
    """Weights + forward. Not an nn.Module: there is nothing to train or register.

    Under tensor parallelism ``weights`` holds this rank's slices (tp_shard.load_shard):
    q/k/v, gate/up and the vocabulary rows of the embedding and LM head split by rows, o_proj
    and down_proj by columns; ``num_heads``/``num_kv_heads`` are this rank's counts.
    """

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype, device,
        tp: TPComm | None = None, *, native_options: native.NativeOptions | None = None,
        native_gemm: bool = True, native_decoder: bool = True, weight_format: str = "fp32",
    ):
        """``native_*``: the executor's switches (executor_svc/settings.py); the defaults use
        the C++ library, its GEMM and its decoder wherever they apply (fp32 on the CPU).
        ``weight_format``: as weight_formats.resolve decided (``weights`` then holds
        RawTensors for "native")."""
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.num_heads = len(tp.layout.q_heads) if tp else config.num_heads
        self.num_kv_heads = len(tp.layout.kv_heads) if tp else config.num_kv_heads

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint has no tensor {name!r}: not a Llama-family model?")
            w = weights.pop(name)
            return w if isinstance(w, quant.RawTensor) else w.to(device=device, dtype=dtype)

        self.embed = take("model.embed_tokens.weight")  # [V, H]
        self.norm = take("model.norm.weight")  # [H]
        lm_head = weights.pop("lm_head.weight", None)
        tied = config.tie_word_embeddings or lm_head is None
        if not tied and not isinstance(lm_head, quant.RawTensor):
            lm_head = lm_head.to(device=device, dtype=dtype)
        self.lm_head = self.embed if tied else lm_head  # [V, H]
        self.layers = [_Layer.load(i, take) for i in range(config.num_layers)]
        self.inv_freq = rope_inv_freq(config).to(device)  # [D / 2] fp32
        self.scale = 1.0 / math.sqrt(config.head_dim)
        # The fused residual-add + RMSNorm (kernels/cpu_attention.cpp) for fp32 on the CPU.
        cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
        self._native = native.load(native_options) if cpu_fp32 else None
        self._decoder: NativeDecoder | None = None
        self.weight_format = weight_format if self._native is not None and native_gemm else "fp32"
        if self.weight_format != weight_format:
            raise ValueError(f"weight format {weight_format} needs the native GEMM")
        if self._native is not None and native_gemm:
            self._pack_weights(self._native, native_decoder)

    def _pack_weights(self, lib: native.NativeKernels, decoder: bool) -> None:
        """Every projection and the LM head into the native GEMM's form for the weight
        format (fp32: packed panels, the plain tensors dropped, a tied LM head keeping the
        embedding for the lookup: +113 MB here; native / bf16: blocks, the embedding's own
        serving both); and, if ``decoder`` (and not under tp), the native decoder that runs
        a step's layers in one call."""
        fmt, tied = self.weight_format, self.lm_head is self.embed
        for layer in self.layers:
            for name in ("wqkv", "wo", "w13", "w2"):
                setattr(layer, name, prepare(lib, getattr(layer, name), fmt))
        self.embed = embedding(lib, self.embed, fmt)
        head = self.embed if tied else self.lm_head
        self.lm_head = head if isinstance(head, quant.QuantWeight) else prepare(lib, head, fmt)
        if fmt == "hybrid" and isinstance(self.lm_head, quant.QuantWeight):
            self.lm_head.add_wide_copy()  # the LM head's GEMM (the lookup reads the blocks)
        if self.tp is None and decoder:
            c = self.config
            self._decoder = NativeDecoder(
                lib, [(lay.attn_norm, lay.wqkv, lay.wo, lay.ffn_norm, lay.w13, lay.w2)
                      for lay in self.layers],
                c.hidden_size, c.intermediate_size, self.num_heads, self.num_kv_heads,
                c.head_dim, c.rms_norm_eps, self.scale)

    def _run_natively(self, x, cos, sin, slot_mapping, backend, prepared, kv) -> bool:
        """Runs every layer in one native call when the backend's AVX2 kernel reads the pool
        (same values as the loop in ``forward``); False if not."""
        plan_of = getattr(backend, "native_plan", None)
        if self._decoder is None or plan_of is None or x.device.type != "cpu":
            return False
        plan = plan_of(prepared, kv.device_pool, self.config.head_dim)
        if plan is None:
            return False
        self._decoder(x, cos, sin, slot_mapping.contiguous(), kv.device_pool, *plan)
        return True

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        """x [H, T] += delta (in place, if given); returns RMSNorm(x) * weight, [H, T]."""
        if self._native is not None:
            return self._native.add_rms_norm(x, delta, weight, self.config.rms_norm_eps)
        if delta is not None:
            x += delta
        return rms_norm(x, weight, self.config.rms_norm_eps, dim=0)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: one native pass for fp32 on the CPU (the native decoder's), else
        torch's two ops (``gate`` is overwritten then)."""
        if self._native is not None:
            return self._native.silu_mul(gate, up)
        return F.silu(gate, inplace=True).mul_(up)

    def qkv_rows(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's fused projection qkv [(Hq + 2 Hkv) D, T] -> the token-major q [T, Hq, D],
        k and v [T, Hkv, D] the attention backends and the KV cache take, RoPE applied to
        q and k (cos / sin [D, T])."""
        dim, t = cos.shape
        if self._native is not None and dim % 8 == 0:  # one call: RoPE + the three layouts
            return self._native.rope_qkv(qkv, cos, sin, num_heads, num_kv_heads)
        n_qk = (num_heads + num_kv_heads) * dim
        rows = torch.empty(t, qkv.shape[0], dtype=qkv.dtype, device=qkv.device)
        rows_t = rows.t()  # [(Hq + 2 Hkv) D, T] view: RoPE writes q and k straight into it
        apply_rope(qkv[:n_qk].view(num_heads + num_kv_heads, dim, t), cos, sin,
                   out=rows_t[:n_qk].view(num_heads + num_kv_heads, dim, t))
        rows_t[n_qk:].copy_(qkv[n_qk:])  # v is copied across
        return (rows[:, : num_heads * dim].view(t, num_heads, dim),
                rows[:, num_heads * dim : n_qk].view(t, num_kv_heads, dim),
                rows[:, n_qk:].view(t, num_kv_heads, dim))

    @staticmethod
    def load(path: pathlib.Path, dtype=torch.float32, device="cpu", tp: TPComm | None = None,
             *, native_options: native.NativeOptions | None = None, native_gemm: bool = True,
             native_decoder: bool = True, weight_format: str = "auto") -> LlamaModel:
        """The checkpoint in ``path``; under tp only this rank's slices are read
        (tp_shard.load_shard: a rank never holds the whole model). ``weight_format``: auto,
        native, hybrid, fp32 or bf16 (executor_svc/weight_formats.py; ValueError if not
        possible)."""
        config = ModelConfig.from_dir(path)
        cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
        lib = native.load(native_options) if cpu_fp32 else None
        fmt = resolve(weight_format, path, lib, native_gemm, tp is not None)
        if tp is not None:
            weights = load_shard(path, config, tp.layout)
        elif fmt in ("native", "hybrid"):
            weights = read_native(path)
        else:
            weights = {}
            for file in sorted(path.glob("*.safetensors")):
                weights.update(load_file(str(file)))
        return LlamaModel(config, weights, dtype, device, tp, native_options=native_options,
                          native_gemm=native_gemm, native_decoder=native_decoder,
                          weight_format=fmt)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Per step, not a table: a 128k-position model would need 128 MB of it. In fp32
        # like transformers, then cast. Hidden-major like the activations.
        freqs = self.inv_freq[:, None] * positions.float()[None, :]  # [D/2, T]
        emb = torch.cat((freqs, freqs), dim=0)  # [D, T]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        slot_mapping: torch.Tensor,  # [T] int64, where each token's K/V goes
        meta: AttentionMetadata,
        backend: AttentionBackend,
        kv: KVCache,
        sample_rows: torch.Tensor,  # [S] int64, rows whose next-token logits are needed
    ) -> torch.Tensor:  # [S, V] float32
        # [T, H]; vocab-parallel: each rank looks up the ids in its slice, then all-reduce.
        x = self.embed[input_ids] if self.tp is None else self.tp.embed(self.embed, input_ids)
        x = x.t().contiguous()  # [H, T], hidden-major from here on
        cos, sin = self._rope(positions)  # [D, T] each
        prepared = backend.prepare(meta)
        if not self._run_natively(x, cos, sin, slot_mapping, backend, prepared, kv):
            ffn = None  # a layer's FFN output, added to x by the next layer's first norm
            for i, layer in enumerate(self.layers):
                ffn = layer.forward(self, x, ffn, cos, sin, i, slot_mapping, backend, prepared,
                                    kv)
            if ffn is not None:
                x += ffn
        # Only sampling rows need the LM head (~6 ms per row on 2 CPU cores).
        if isinstance(self.lm_head, native.PackedWeight | quant.QuantWeight):  # [S, V]
            h = rms_norm(x[:, sample_rows], self.norm, self.config.rms_norm_eps, dim=0)  # [H, S]
            logits = self.lm_head.mm_t(h)
        else:
            h = rms_norm(x[:, sample_rows].t(), self.norm, self.config.rms_norm_eps)  # [S, H]
            logits = linear(h, self.lm_head).float()  # [S, V] ([S, V / tp] under tp)
        # Under tp only rank 0 gets the whole [S, V] (it samples); the others keep their slice.
        return logits if self.tp is None else self.tp.gather_logits(logits)


@dataclass
class _Layer:
    # The four projections are tensors or, once LlamaModel packs them, native.PackedWeight.
    attn_norm: torch.Tensor  # [H]
    wqkv: Weight  # [(Hq + 2 Hkv) D, H]
    wo: Weight  # [H, Hq D]
    ffn_norm: torch.Tensor  # [H]
    w13: Weight  # [2 I, H] gate rows, then up rows
    w2: Weight  # [H, I]

    @staticmethod
    def load(i: int, take) -> _Layer:
        # take(name) pops one checkpoint tensor, cast and placed; q/k/v and gate/up are fused.
        p = f"model.layers.{i}."
        qkv = [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
        gate_up = [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
        return _Layer(
            attn_norm=take(p + "input_layernorm.weight"),
            wqkv=fuse(qkv),
            wo=take(p + "self_attn.o_proj.weight"),
            ffn_norm=take(p + "post_attention_layernorm.weight"),
            w13=fuse(gate_up),
            w2=take(p + "mlp.down_proj.weight"),
        )

    def forward(self, model: LlamaModel, x, ffn, cos, sin, i, slot_mapping, backend, prepared,
                kv):
        """Adds ``ffn`` (the previous layer's FFN output, or None) and this layer's attention
        output to x [H, T] in place; returns this layer's FFN output [H, T], not yet added
        (the next norm fuses the add)."""
        # Hq, Hkv and I are this rank's shares under tp; x stays whole [H, T] on every rank.
        hq, hkv, tp = model.num_heads, model.num_kv_heads, model.tp
        t = x.shape[1]
        h = model.add_norm(x, ffn, self.attn_norm)  # [H, T]
        qkv = project(self.wqkv, h)  # [(Hq + 2 Hkv) D, T]
        q, k, v = model.qkv_rows(qkv, cos, sin, hq, hkv)  # [T, Hq | Hkv, D]
        kv.write(i, k, v, slot_mapping)
        o = backend.forward(q, k, v, kv.key_cache(i), kv.value_cache(i), prepared, model.scale)
        attn = project(self.wo, o.reshape(t, -1).t())  # [H, T]; a partial sum under tp
        if tp is not None:
            tp.all_reduce(attn)
        h = model.add_norm(x, attn, self.ffn_norm)
        gate_up = project(self.w13, h)  # [2 I, T]: gate rows, then up rows
        inter = gate_up.shape[0] // 2
        act = model.swiglu(gate_up[:inter], gate_up[inter:])  # [I, T]
        ffn = project(self.w2, act)  # [H, T]; a partial sum under tp
        if tp is not None:
            tp.all_reduce(ffn)
        return ffn

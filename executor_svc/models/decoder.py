"""The forward pass of every registered architecture (executor_svc/models/registry.py) over
a flattened (varlen) batch with a paged KV cache: a pre-norm decoder (RMSNorm, rotate-half
RoPE, GQA, SwiGLU); q/k/v biases and q/k RMSNorm are ``DecoderLayer.adjust_qkv``'s hooks, a
layer's sliding window (ModelConfig.layer_windows) goes to its attention call.

gpt-fast style, shapes in comments: T = tokens this step (all sequences), S = rows that
sample. Between layers activations are hidden-major [H, T], so each projection is
``W @ x`` with no transposing copy; only q/k/v become token-major [T, heads, D]. The math
follows transformers op for op (models/ops.py), so greedy outputs match it token for
token. With ``tp`` None (tp_size 1) the forward makes no collective call and no copy.
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
from executor_svc.lora import LoraBatch
from executor_svc.model_config import ModelConfig
from executor_svc.models import registry
from executor_svc.models.base import LAYER_PREFIX, Architecture
from executor_svc.models.ops import Weight, apply_rope, linear, project, rms_norm, rope_inv_freq
from executor_svc.tp_shard import load_shard
from executor_svc.weight_formats import embedding, fuse, prepare, read_native, resolve
from kernels import native, quant
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.native_decoder import NativeDecoder

if TYPE_CHECKING:
    from executor_svc.settings import Switches
    from executor_svc.tp_comm import TPComm


def native_options(switches: Switches) -> native.NativeOptions:
    """The environment's library switches (executor_svc/settings.py) in the form
    kernels/native.py's ``load`` takes."""
    return native.NativeOptions(enabled=switches.native_kernels, cache_dir=switches.kernel_cache,
                                compiler=switches.compiler, isa=switches.cpu_isa)


def model_options(switches: Switches) -> dict:
    """DecoderModel's keyword arguments for the environment's switches."""
    return {"native_options": native_options(switches), "native_gemm": switches.native_gemm,
            "native_decoder": switches.native_decoder, "weight_format": switches.weight_format}


class DecoderModel:
    """Weights + forward. Not an nn.Module: there is nothing to train or register.
    ``architecture``: the registry's declaration for ``config`` (which tensors, whether the
    native decoder can run it).

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
        self.architecture = arch = registry.architecture(config.architecture)
        self.dtype = dtype
        self.tp = tp
        self.num_heads = len(tp.layout.q_heads) if tp else config.num_heads
        self.num_kv_heads = len(tp.layout.kv_heads) if tp else config.num_kv_heads

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint has no tensor {name!r}: not a {arch.name} model?")
            w = weights.pop(name)
            return w if isinstance(w, quant.RawTensor) else w.to(device=device, dtype=dtype)

        names = {t.role: t.hf for t in arch.global_tensors}
        self.embed = take(names["embed"])  # [V, H]
        # transformers multiplies by the scale as a tensor of the embedding's dtype.
        self.embed_scale = (None if config.embed_scale is None else
                            torch.tensor(config.embed_scale, dtype=dtype, device=device))
        self.norm = norm_weight(take(names["norm"]), config)  # [H]
        lm_head = weights.pop(names["lm_head"], None)
        tied = config.tie_word_embeddings or lm_head is None
        if not tied and not isinstance(lm_head, quant.RawTensor):
            lm_head = lm_head.to(device=device, dtype=dtype)
        self.lm_head = self.embed if tied else lm_head  # [V, H]
        # One RoPE frequency table per distinct base; a layer reads its own (rope_index).
        thetas = list(dict.fromkeys(config.layer_rope_thetas or (config.rope_theta,)))
        self.inv_freqs = [rope_inv_freq(config, theta).to(device) for theta in thetas]  # [D/2]
        self.layers = [DecoderLayer.load(i, take, config, arch, thetas)
                       for i in range(config.num_layers)]
        self.scale = config.attn_scale or 1.0 / math.sqrt(config.head_dim)
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
        if self.tp is None and decoder and self.architecture.native_decoder:
            c = self.config
            self._decoder = NativeDecoder(
                lib, [(lay.attn_norm, lay.wqkv, lay.wo, lay.ffn_norm, lay.w13, lay.w2)
                      for lay in self.layers],
                c.hidden_size, c.intermediate_size, self.num_heads, self.num_kv_heads,
                c.head_dim, c.rms_norm_eps, self.scale,
                windows=[lay.window or 0 for lay in self.layers])

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

    def gated_act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, the architecture's activation: silu in one native pass for fp32
        on the CPU (the native decoder's), else torch's two ops (``gate`` is overwritten
        then); gelu (tanh approximation) as transformers' gelu_pytorch_tanh."""
        if self.config.hidden_act == "gelu_tanh":
            return F.gelu(gate, approximate="tanh").mul_(up)
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
             native_decoder: bool = True, weight_format: str = "auto") -> DecoderModel:
        """The checkpoint in ``path``; under tp only this rank's slices are read
        (tp_shard.load_shard: a rank never holds the whole model). ``weight_format``: auto,
        native, hybrid, fp32 or bf16 (executor_svc/weight_formats.py; ValueError if not
        possible). The class is the same for every architecture (the checkpoint's
        config.json names it: executor_svc/models/registry.py)."""
        config = registry.read_config(path)
        cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
        lib = native.load(native_options) if cpu_fp32 else None
        fmt = resolve(weight_format, path, lib, native_gemm, tp is not None)
        if tp is not None:
            weights = load_shard(path, config, tp.layout,
                                 registry.architecture(config.architecture))
        elif fmt in ("native", "hybrid"):
            weights = read_native(path)
        else:
            weights = {}
            for file in sorted(path.glob("*.safetensors")):
                weights.update(load_file(str(file)))
        return DecoderModel(config, weights, dtype, device, tp, native_options=native_options,
                            native_gemm=native_gemm, native_decoder=native_decoder,
                            weight_format=fmt)

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        # Per step, not a table: a 128k-position model would need 128 MB of it. In fp32
        # like transformers, then cast. Hidden-major like the activations.
        freqs = inv_freq[:, None] * positions.float()[None, :]  # [D/2, T]
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
        lora: LoraBatch | None = None,  # the step's adapters per token; None: none active
    ) -> torch.Tensor:  # [S, V] float32
        if lora is not None and self.tp is not None:
            raise ValueError("LoRA adapters are not supported under tensor parallelism")
        if lora is not None and not lora.groups:  # every row on the base model
            lora = None
        # [T, H]; vocab-parallel: each rank looks up the ids in its slice, then all-reduce.
        x = self.embed[input_ids] if self.tp is None else self.tp.embed(self.embed, input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        x = x.t().contiguous()  # [H, T], hidden-major from here on
        ropes = [self._rope(positions, f) for f in self.inv_freqs]  # ([D, T], [D, T]) each
        prepared = backend.prepare(meta)
        # The native decoder fuses each layer's projections with no place for a delta: a
        # step with any LoRA row takes the per-op layers (the same values for base rows).
        if lora is not None or not self._run_natively(x, *ropes[0], slot_mapping, backend,
                                                      prepared, kv):
            ffn = None  # a layer's FFN output, added to x by the next layer's first norm
            for i, layer in enumerate(self.layers):
                ffn = layer.forward(self, x, ffn, *ropes[layer.rope_index], i, slot_mapping,
                                    backend, prepared, kv, lora)
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
class DecoderLayer:
    # The four projections are tensors or, once DecoderModel packs them, native.PackedWeight
    # (or quant.QuantWeight); the optional parts are None where the architecture has none.
    attn_norm: torch.Tensor  # [H]
    wqkv: Weight  # [(Hq + 2 Hkv) D, H]
    wo: Weight  # [H, Hq D]
    ffn_norm: torch.Tensor  # [H]
    w13: Weight  # [2 I, H] gate rows, then up rows
    w2: Weight  # [H, I]
    bqkv: torch.Tensor | None = None  # [(Hq + 2 Hkv) D]: q, k, v biases (Qwen2)
    q_norm: torch.Tensor | None = None  # [D]: every query head's RMSNorm weight (Qwen3)
    k_norm: torch.Tensor | None = None  # [D]: every KV head's
    window: int | None = None  # sliding attention window in tokens (Mistral); None: full
    rope_index: int = 0  # which of DecoderModel.inv_freqs its RoPE uses
    post_attn_norm: torch.Tensor | None = None  # [H]: on the attention output (Gemma)
    post_ffn_norm: torch.Tensor | None = None  # [H]: on the FFN output (Gemma)

    @staticmethod
    def load(i: int, take, config: ModelConfig, arch: Architecture,
             thetas: list[float]) -> DecoderLayer:
        # take(name) pops one checkpoint tensor, cast and placed; q/k/v and gate/up are fused.
        names = {t.role: f"{LAYER_PREFIX}{i}.{t.hf}" for t in arch.layer_tensors
                 if t.present(config)}

        def get(role: str):
            if role not in names:
                raise ValueError(f"{arch.name} declares no {role!r} tensor for {config.name}")
            return take(names[role])

        def norm(role: str):
            return norm_weight(get(role), config)

        biases = [get(r) for r in ("q_bias", "k_bias", "v_bias")] if config.qkv_bias else None
        sandwich = config.sandwich_norms
        return DecoderLayer(
            attn_norm=norm("attn_norm"),
            wqkv=fuse([get(r) for r in ("q", "k", "v")]),
            wo=get("o"),
            ffn_norm=norm("ffn_norm"),
            w13=fuse([get(r) for r in ("gate", "up")]),
            w2=get("down"),
            bqkv=None if biases is None else torch.cat(biases),
            q_norm=norm("q_norm") if config.qk_norm else None,
            k_norm=norm("k_norm") if config.qk_norm else None,
            window=config.layer_windows[i] if config.layer_windows else None,
            rope_index=thetas.index(config.layer_rope_thetas[i]) if config.layer_rope_thetas
            else 0,
            post_attn_norm=norm("post_attn_norm") if sandwich else None,
            post_ffn_norm=norm("post_ffn_norm") if sandwich else None,
        )

    def adjust_qkv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                   eps: float) -> None:
        """The architecture's hooks on the fused projection qkv [(Hq + 2 Hkv) D, T], in
        place, before RoPE: + the q/k/v biases; RMSNorm over each q and k head (as
        transformers' q_norm / k_norm, over head_dim)."""
        if self.bqkv is not None:
            qkv += self.bqkv[:, None]
        if self.q_norm is not None:
            t = qkv.shape[1]
            dim = self.q_norm.shape[0]
            q = qkv[: num_heads * dim].view(num_heads, dim, t)
            k = qkv[num_heads * dim : (num_heads + num_kv_heads) * dim].view(num_kv_heads, dim, t)
            q.copy_(rms_norm(q, self.q_norm, eps, dim=1))
            k.copy_(rms_norm(k, self.k_norm, eps, dim=1))

    def forward(self, model: DecoderModel, x, ffn, cos, sin, i, slot_mapping, backend, prepared,
                kv, lora: LoraBatch | None = None):
        """Adds ``ffn`` (the previous layer's FFN output, or None) and this layer's attention
        output to x [H, T] in place; returns this layer's FFN output [H, T], not yet added
        (the next norm fuses the add). ``lora``: adapter deltas join each projection's
        output (fused q/k/v and gate/up by rows) before anything else reads it."""
        # Hq, Hkv and I are this rank's shares under tp; x stays whole [H, T] on every rank.
        hq, hkv, tp = model.num_heads, model.num_kv_heads, model.tp
        t = x.shape[1]
        h = model.add_norm(x, ffn, self.attn_norm)  # [H, T]
        qkv = project(self.wqkv, h)  # [(Hq + 2 Hkv) D, T]
        if lora is not None:
            lora.add(i, "qkv", h, qkv)
        if self.bqkv is not None or self.q_norm is not None:
            self.adjust_qkv(qkv, hq, hkv, model.config.rms_norm_eps)
        q, k, v = model.qkv_rows(qkv, cos, sin, hq, hkv)  # [T, Hq | Hkv, D]
        kv.write(i, k, v, slot_mapping)
        o = backend.forward(q, k, v, kv.key_cache(i), kv.value_cache(i), prepared, model.scale,
                            window=self.window)
        o = o.reshape(t, -1).t()  # [Hq D, T]
        attn = project(self.wo, o)  # [H, T]; a partial sum under tp
        if lora is not None:
            lora.add(i, "o", o, attn)
        if tp is not None:
            tp.all_reduce(attn)
        eps = model.config.rms_norm_eps
        if self.post_attn_norm is not None:
            attn = rms_norm(attn, self.post_attn_norm, eps, dim=0)
        h = model.add_norm(x, attn, self.ffn_norm)
        gate_up = project(self.w13, h)  # [2 I, T]: gate rows, then up rows
        if lora is not None:
            lora.add(i, "gate_up", h, gate_up)
        inter = gate_up.shape[0] // 2
        act = model.gated_act(gate_up[:inter], gate_up[inter:])  # [I, T]
        ffn = project(self.w2, act)  # [H, T]; a partial sum under tp
        if lora is not None:
            lora.add(i, "down", act, ffn)
        if tp is not None:
            tp.all_reduce(ffn)
        if self.post_ffn_norm is not None:
            ffn = rms_norm(ffn, self.post_ffn_norm, eps, dim=0)
        return ffn


def norm_weight(w: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """An RMSNorm weight as the forward multiplies by it: Gemma's offset + w is computed
    once, in fp32 as transformers does (then in the weight's dtype)."""
    if not config.norm_offset or isinstance(w, quant.RawTensor):
        return w
    return (w.float() + config.norm_offset).to(w.dtype)

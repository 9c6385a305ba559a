"""Qwen3 (dense): the Llama layer with an RMSNorm over each q and k head (one [head_dim]
weight for all query heads, one for all KV heads) before RoPE, and no biases; head_dim is
its own (128 where hidden / heads is 64, in the small sizes). The q/k norms keep it off the
native fused decoder; it runs the per-op path (the same native GEMM, norm and RoPE
kernels, one call each)."""

from __future__ import annotations

from executor_svc.models.base import DECODER_LAYER, QK_NORMS, Architecture, refuse
from executor_svc.models.qwen2 import QWEN2_TOKENIZER


def _fields(raw: dict) -> dict:
    # attention_bias biases o_proj as well as q/k/v.
    refuse(raw, "qwen3", "attention_bias")
    return {"qk_norm": True}


QWEN3 = Architecture(
    name="qwen3",
    model_types=("qwen3",),
    hf_class="Qwen3ForCausalLM",
    layer_tensors=DECODER_LAYER + QK_NORMS,
    config_fields=_fields,
    gguf_arch="qwen3",
    gguf_config={"attention_bias": False, "use_sliding_window": False},
    gguf_pre_tokenizers=QWEN2_TOKENIZER,
)

"""Llama (and the models that share its config.json: SmolLM2, Llama 3.x): the base
decoder layer as is. The one architecture whose GGUF q/k rows llama.cpp permutes for its
interleaved RoPE, and the one the native fused decoder (kernels/cpu_decoder.cpp) runs."""

from __future__ import annotations

from executor_svc.models.base import DECODER_LAYER, Architecture, refuse


def _fields(raw: dict) -> dict:
    # attention_bias puts a bias on o_proj as well; mlp_bias on the FFN: neither is here.
    refuse(raw, "llama", "attention_bias", "mlp_bias")
    return {}


LLAMA = Architecture(
    name="llama",
    model_types=("llama",),
    hf_class="LlamaForCausalLM",
    layer_tensors=DECODER_LAYER,
    config_fields=_fields,
    gguf_arch="llama",
    gguf_rope_permuted=True,
    gguf_config={"attention_bias": False, "mlp_bias": False},
    native_decoder=True,
)

"""Qwen2 and Qwen2.5: the Llama layer with a bias on q_proj, k_proj and v_proj (always;
o_proj has none). Small sizes tie the LM head to the embedding. With
``use_sliding_window`` the layers from ``max_window_layers`` on (or those ``layer_types``
names) attend over a window of ``sliding_window`` tokens (base.layer_windows); the released
checkpoints turn it off. Biases keep it off the native fused decoder; it runs the per-op
path (the same native GEMM, norm and RoPE kernels, one call each)."""

from __future__ import annotations

from executor_svc.models.base import DECODER_LAYER, QKV_BIASES, Architecture, PreTokenizer

# Its tokenizer's (Qwen3's too): digits one by one, NFC first.
QWEN2_TOKENIZER = {"qwen2": PreTokenizer(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", nfc=True)}


def _fields(raw: dict) -> dict:
    return {"qkv_bias": True}


QWEN2 = Architecture(
    name="qwen2",
    model_types=("qwen2",),
    hf_class="Qwen2ForCausalLM",
    layer_tensors=DECODER_LAYER + QKV_BIASES,
    config_fields=_fields,
    gguf_arch="qwen2",
    gguf_config={"use_sliding_window": False},
    gguf_pre_tokenizers=QWEN2_TOKENIZER,
)

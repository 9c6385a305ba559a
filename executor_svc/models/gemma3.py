"""Gemma 3 (text): the decoder layer with four norms instead of two (each of the attention
and FFN outputs is normalized before it joins the residual stream, and normalized again
before the FFN), per-head q/k RMSNorm, a GELU-gated FFN (tanh approximation), embeddings
scaled by sqrt(hidden), norm weights that act as 1 + w, an attention scale of its own
(query_pre_attn_scalar), a tied 262k-entry LM head, and local sliding-window layers
interleaved with global ones, each kind with its own RoPE base (10k local, 1M global).

The norms, activation and per-layer RoPE keep it off the native fused decoder. Its GGUF
files hold no chat template and no layer pattern (llama.cpp: a global layer after every
five local ones, local RoPE base 10k; the converter writes the same). The multimodal
checkpoint (``gemma3``) is refused by name: serve its text model's (``gemma3_text``).
"""

from __future__ import annotations

from collections.abc import Callable

from executor_svc.models.base import (
    DECODER_LAYER,
    QK_NORMS,
    Architecture,
    Tensor,
    layer_windows,
    refuse,
)

# Every sixth layer attends globally (llama.cpp's and transformers' default pattern).
_GLOBAL_EVERY = 6
_LOCAL_ROPE_THETA = 10000.0
_LAYER = tuple(t for t in DECODER_LAYER if t.role != "ffn_norm") + QK_NORMS + (
    # HF's post_attention_layernorm is Gemma's norm on the attention output, not Llama's
    # pre-FFN norm, which Gemma calls pre_feedforward_layernorm.
    Tensor("post_attn_norm", "post_attention_layernorm.weight", "post_attention_norm.weight",
           ("h",)),
    Tensor("ffn_norm", "pre_feedforward_layernorm.weight", "ffn_norm.weight", ("h",)),
    Tensor("post_ffn_norm", "post_feedforward_layernorm.weight", "post_ffw_norm.weight",
           ("h",)),
)

# Gemma's turn format: a system message opens the first user turn; the assistant's turns
# are the model's. Tools reach it as plain turns (gateway/tools/tool_fallback.py).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set state = namespace(prefix='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set state.prefix = messages[0]['content'] | trim ~ '\\n\\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- if not turns -%}{%- set turns = [{'role': 'user', 'content': ''}] -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{{- '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else 'user') ~ '\\n' -}}"
    "{%- if loop.first -%}{{- state.prefix -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


def _layer_types(raw: dict) -> list[str]:
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    every = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(raw["num_hidden_layers"])]


def _rope_thetas(raw: dict) -> tuple[float, float]:
    """(global, local) RoPE bases: transformers 5's per-layer-type rope_parameters, or the
    older rope_theta / rope_local_base_freq; any scaling is refused (not implemented)."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        scaled = [p.get("rope_type") for p in (full, local) if p.get("rope_type") != "default"]
        thetas = (full["rope_theta"], local.get("rope_theta", _LOCAL_ROPE_THETA))
    else:
        scaling = raw.get("rope_scaling") or {}
        scaled = [scaling.get("rope_type", scaling.get("type"))] if scaling else []
        thetas = (raw.get("rope_theta", 1e6), raw.get("rope_local_base_freq", _LOCAL_ROPE_THETA))
    if scaled:
        raise ValueError(f"gemma3: RoPE scaling {scaled[0]!r} is not supported (default only)")
    return float(thetas[0]), float(thetas[1])


def _fields(raw: dict) -> dict:
    refuse(raw, "gemma3", "attention_bias", "attn_logit_softcapping",
           "final_logit_softcapping", "use_bidirectional_attention")
    act = raw.get("hidden_activation") or raw.get("hidden_act")
    if act not in (None, "gelu_pytorch_tanh"):
        raise ValueError(f"gemma3: activation {act!r} is not supported (gelu_pytorch_tanh)")
    types = _layer_types(raw)
    full, local = _rope_thetas(raw)
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    head_dim = raw.get("head_dim") or hidden // heads
    return {
        "qk_norm": True,
        "sandwich_norms": True,
        "norm_offset": 1.0,
        "hidden_act": "gelu_tanh",
        "embed_scale": hidden**0.5,
        "attn_scale": float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        "rope_theta": full,
        "rope_scaling": None,
        "layer_rope_thetas": tuple(full if t == "full_attention" else local for t in types),
        "layer_windows": layer_windows({**raw, "layer_types": types}),
        "tie_word_embeddings": raw.get("tie_word_embeddings", True),
    }


def _gguf_config(key: Callable) -> dict:
    """What llama.cpp's Gemma 3 assumes and its files leave out (module docstring)."""
    layers = key("block_count")
    head_dim = key("attention.key_length") or key("embedding_length") // key(
        "attention.head_count")
    rope = float(key("rope.freq_base", 1e6))
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": key("attention.sliding_window"),
        "layer_types": ["full_attention" if (i + 1) % _GLOBAL_EVERY == 0
                        else "sliding_attention" for i in range(layers)],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": rope},
            "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_THETA},
        },
        # llama.cpp scales by 1 / sqrt(head_dim) (all sizes but 27B, whose files it treats
        # apart and this converter does not).
        "query_pre_attn_scalar": head_dim,
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


GEMMA3 = Architecture(
    name="gemma3",
    model_types=("gemma3_text",),
    hf_class="Gemma3ForCausalLM",
    layer_tensors=_LAYER,
    config_fields=_fields,
    gguf_arch="gemma3",
    gguf_sentencepiece=True,
    gguf_norm_offset=1.0,
    gguf_chat_template=CHAT_TEMPLATE,
    gguf_end_tokens=("<end_of_turn>",),
    gguf_extra_config=_gguf_config,
)

"""A Llama of any shape with random weights, made where it will run: the GPU check's
8B-shaped model (scripts/gpu_bench.py: nothing downloaded, 16 GB of bf16 written by the
device itself) and the tests' tiny ones. The values are N(0, 0.02) (norms 1), enough for
timing and for comparing two code paths over the same weights; the tokens mean nothing.
"""

from __future__ import annotations

import torch

from executor_svc.model import LlamaModel
from executor_svc.model_config import ModelConfig

# Llama-3.1-8B's shape (its config.json), the check's model.
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192)


def llama_config(**shape) -> ModelConfig:
    """``shape``: ModelConfig's size fields (LLAMA_8B's names); the rest as Llama 3."""
    fields = dict(rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                  tie_word_embeddings=False, eos_token_ids=(), name="random-llama")
    fields.update(shape)
    return ModelConfig(**fields)


def parameter_count(c: ModelConfig) -> int:
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    ffn = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + ffn + 2 * c.hidden_size) + 2 * c.vocab_size * c.hidden_size


def random_llama(config: ModelConfig, dtype=torch.bfloat16, device="cpu", seed: int = 0,
                 **model_options) -> LlamaModel:
    """The model, every tensor drawn on ``device`` in ``dtype`` (no host copy of 16 GB)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * 0.02

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    h, d = c.hidden_size, c.head_dim
    weights = {"model.embed_tokens.weight": draw(c.vocab_size, h), "model.norm.weight": ones(h),
               "lm_head.weight": draw(c.vocab_size, h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": draw(c.num_heads * d, h),
            p + "self_attn.k_proj.weight": draw(c.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": draw(c.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": draw(h, c.num_heads * d),
            p + "mlp.gate_proj.weight": draw(c.intermediate_size, h),
            p + "mlp.up_proj.weight": draw(c.intermediate_size, h),
            p + "mlp.down_proj.weight": draw(h, c.intermediate_size),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        })
    return LlamaModel(c, weights, dtype, device, **model_options)

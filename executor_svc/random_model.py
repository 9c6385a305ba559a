"""A model of any registered architecture and shape with random weights, made where it will
run: the GPU check's 8B-shaped model (scripts/gpu_bench.py: nothing downloaded, 16 GB of
bf16 written by the device itself) and the tests' tiny ones. Every tensor the architecture
declares (executor_svc/models/base.py) is drawn N(0, 0.02), norms 1: enough for timing and
for comparing two code paths over the same weights; the tokens mean nothing.
"""

from __future__ import annotations

import math

import torch

from executor_svc.model_config import ModelConfig
from executor_svc.models import registry
from executor_svc.models.decoder import DecoderModel

# Llama-3.1-8B's shape (its config.json), the check's model.
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192)


def random_config(architecture: str, **shape) -> ModelConfig:
    """``shape``: ModelConfig's size fields (LLAMA_8B's names) and any of its flags; the
    rest as Llama 3's. ``architecture``: a registered name (KeyError otherwise)."""
    registry.architecture(architecture)
    fields = dict(rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                  tie_word_embeddings=False, eos_token_ids=(), name=f"random-{architecture}")
    fields.update(shape)
    return ModelConfig(architecture=architecture, **fields)


def parameter_count(c: ModelConfig) -> int:
    """Every weight the architecture declares for ``c`` (a tied LM head counted once)."""
    arch = registry.architecture(c.architecture)
    return sum(math.prod(t.size(c)) for _, t in arch.tensors(c))


def random_model(config: ModelConfig, dtype=torch.bfloat16, device="cpu", seed: int = 0,
                 **model_options) -> DecoderModel:
    """The model, every tensor drawn on ``device`` in ``dtype`` (no host copy of 16 GB)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, t in registry.architecture(config.architecture).tensors(config):
        size = t.size(config)
        if len(size) == 1 and t.split is None:  # a norm
            weights[name] = torch.ones(size, device=device, dtype=dtype)
        else:
            weights[name] = torch.randn(size, generator=gen, device=device, dtype=dtype) * 0.02
    return DecoderModel(config, weights, dtype, device, **model_options)

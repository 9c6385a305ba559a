"""What an HF Llama ``config.json`` says about the model: the one type that both the forward
pass (model.py) and the tensor-parallel split (tp_shard.py) need, so it sits below both and
neither imports the other for it."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF Llama config.json this forward pass needs."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    name: str

    @staticmethod
    def from_dir(path: pathlib.Path) -> ModelConfig:
        raw = json.loads((path / "config.json").read_text())
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        eos = raw.get("eos_token_id")
        return ModelConfig(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=rope if rope.get("rope_type", rope.get("type")) == "llama3" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            name=raw.get("_name_or_path") or path.name,
        )

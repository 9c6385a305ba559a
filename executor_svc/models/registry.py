"""The architectures the executor serves, by Hugging Face ``model_type`` and by GGUF
``general.architecture``: the one list, and the only place outside their own modules
where they are named. Torch-free, like the declarations it lists."""

from __future__ import annotations

import json
import pathlib

from executor_svc.model_config import ModelConfig
from executor_svc.models.base import Architecture
from executor_svc.models.gemma3 import GEMMA3
from executor_svc.models.llama import LLAMA
from executor_svc.models.mistral import MINISTRAL, MISTRAL
from executor_svc.models.qwen2 import QWEN2
from executor_svc.models.qwen3 import QWEN3

ARCHITECTURES: tuple[Architecture, ...] = (LLAMA, QWEN2, QWEN3, MISTRAL, MINISTRAL,
                                           GEMMA3)
_BY_NAME = {a.name: a for a in ARCHITECTURES}
_BY_MODEL_TYPE = {t: a for a in ARCHITECTURES for t in a.model_types}
_BY_GGUF = {a.gguf_arch: a for a in ARCHITECTURES if a.gguf_arch}


class UnsupportedModel(ValueError):
    """A model_type or GGUF architecture no registered architecture declares."""


def model_types() -> tuple[str, ...]:
    return tuple(_BY_MODEL_TYPE)


def gguf_architectures() -> tuple[str, ...]:
    return tuple(_BY_GGUF)


def architecture(name: str) -> Architecture:
    """By ModelConfig.architecture (the registry's own name)."""
    return _BY_NAME[name]


def for_model_type(model_type: str | None) -> Architecture:
    if model_type not in _BY_MODEL_TYPE:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported; supported: "
                               f"{', '.join(model_types())}")
    return _BY_MODEL_TYPE[model_type]


def for_gguf(gguf_arch: str | None) -> Architecture:
    if gguf_arch not in _BY_GGUF:
        raise UnsupportedModel(f"GGUF architecture {gguf_arch!r} is not supported; supported: "
                               f"{', '.join(gguf_architectures())}")
    return _BY_GGUF[gguf_arch]


def read_config(path: pathlib.Path) -> ModelConfig:
    """``path``/config.json as ModelConfig, by its architecture (UnsupportedModel, or a
    ValueError naming a feature its architecture cannot serve)."""
    raw = json.loads((path / "config.json").read_text())
    return for_model_type(raw.get("model_type")).read_config(raw, path.name)

"""Mistral (7B and the checkpoints that share its config.json, Mistral Nemo among them):
the Llama layer as is, every layer's attention limited to a sliding window of
``sliding_window`` tokens, the last W positions a query sees, itself included
(7B v0.1: 4096; null, as v0.2 onwards write it: full attention). And Ministral
(transformers' ``ministral``): the same layer, ``layer_types`` choosing per layer between
that window and full attention.

transformers' Mistral class reads no ``layer_types``: it windows every layer whatever the
file says (and 4096 where ``sliding_window`` is absent), so a Mistral config.json that
mixes layer types is refused rather than served one way or the other. The windows are
read here, not by base.layer_windows: that one needs ``layer_types`` or Qwen2's keys. No
biases, no q/k norms: the native fused decoder (kernels/cpu_decoder.cpp) runs both, each
layer under its own window. No GGUF: llama.cpp writes Mistral 7B as ``llama``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from executor_svc.model_config import ModelConfig
from executor_svc.models.base import DECODER_LAYER, Architecture

SLIDING, FULL = "sliding_attention", "full_attention"
_DEFAULT_WINDOW = 4096  # MistralConfig's and MinistralConfig's, for a config.json without one


def _window(raw: dict) -> int | None:
    return raw.get("sliding_window", _DEFAULT_WINDOW) or None


def mistral_windows(raw: dict, name: str) -> tuple[int | None, ...]:
    """Every layer ``sliding_window`` (None: full), as MistralForCausalLM applies it."""
    window, types = _window(raw), raw.get("layer_types")
    if window and types and any(t != SLIDING for t in types):
        raise ValueError(f"{name}: layer_types mixes full and sliding layers, which "
                         "transformers' Mistral class ignores (it windows every layer); "
                         "for per-layer windows write model_type ministral")
    return (window,) * raw["num_hidden_layers"]


def ministral_windows(raw: dict, name: str) -> tuple[int | None, ...]:
    """Each layer's by ``layer_types`` (all sliding when absent, as MinistralConfig
    defaults them), the window ``sliding_window``."""
    window, layers = _window(raw), raw["num_hidden_layers"]
    types = raw.get("layer_types") or [SLIDING if window else FULL] * layers
    if len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"{name}: layer_types {types} is not one of {SLIDING!r} / {FULL!r} "
                         f"for each of its {layers} layers")
    return tuple(window if t == SLIDING else None for t in types)


@dataclasses.dataclass(frozen=True)
class _Windowed(Architecture):
    """An architecture whose per-layer windows ``windows(raw, name)`` reads from config.json."""

    windows: Callable[[dict, str], tuple[int | None, ...]] = mistral_windows

    def read_config(self, raw: dict, name: str) -> ModelConfig:
        config = super().read_config(raw, name)
        return dataclasses.replace(config, layer_windows=self.windows(raw, name))


def _fields(raw: dict) -> dict:
    return {}


MISTRAL = _Windowed(
    name="mistral",
    model_types=("mistral",),
    hf_class="MistralForCausalLM",
    layer_tensors=DECODER_LAYER,
    config_fields=_fields,
    native_decoder=True,
    windows=mistral_windows,
)
MINISTRAL = _Windowed(
    name="ministral",
    model_types=("ministral",),
    hf_class="MinistralForCausalLM",
    layer_tensors=DECODER_LAYER,
    config_fields=_fields,
    native_decoder=True,
    windows=ministral_windows,
)

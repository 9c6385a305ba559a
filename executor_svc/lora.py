"""LoRA adapters in the executor: a PEFT directory read and checked against the base
model, the device slots that hold loaded adapters, and one step's per-token application.

A LoRA adapter adds ``B @ A @ x * scaling`` to a projection's output (A [r, in], B
[out, r]; scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora), as PEFT's
``lora.Linear`` does in eval mode. Here the scaling is folded into B once, at load. Only
PEFT's safetensors are read, never a pickle. Each token of a step names a slot (-1: the
base model); a projection adds, per slot present in the step, ``B @ (A @ x[:, rows])`` to
its output's columns (on the CPU two small GEMMs per adapter beat a gathered kernel). A
base token's columns are never written: they equal a step with no LoRA at all, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from executor_svc.model_config import ModelConfig
from executor_svc.models import registry
from executor_svc.models.base import LAYER_PREFIX

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT names an adapter's tensors after the wrapped model's modules: PeftModel wraps the
# CausalLM as ``base_model.model``.
_PEFT_PREFIX = "base_model.model."
# The decoder's fused projections (executor_svc/models/decoder.py) and the PEFT modules
# whose outputs each stacks by rows, in row order; the Architecture's role for each.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
}
_ROLE = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
         "up_proj": "up", "down_proj": "down"}
MODULES = tuple(_ROLE)
# adapter_config.json keys read here, and those that change nothing at inference
# (metadata, training-time dropout, initialisers that leave the base weights alone). Any
# other key must be off (None, False, empty): an option not implemented is refused by name.
_READ = {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "bias"}
_INERT = {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
          "inference_mode", "exclude_modules", "lora_dropout", "init_lora_weights",
          "layers_to_transform", "layers_pattern", "megatron_core", "qalora_group_size",
          "runtime_config", "eva_config", "ensure_weight_tying"}
# Initialisers that rewrite the base weights: such an adapter only fits the model it was
# trained beside unless PEFT converted it when saving.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_KEY = re.compile(re.escape(_PEFT_PREFIX + LAYER_PREFIX)
                  + r"(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")


class LoraError(ValueError):
    """An adapter this executor cannot serve; the message says why."""


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter. ``weights[layer][module]`` = (A [r, in], B [out, r] with the
    scaling folded in), fp32, for the modules it adapts in that layer (layers_to_transform
    may leave layers out). ``digest``: sha256 over its config and safetensors bytes (what
    a prefix cache keys an adapter's KV by)."""

    name: str
    rank: int
    weights: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]
    digest: str


def load_adapter(path: str | pathlib.Path, model_config: ModelConfig, max_rank: int,
                 name: str | None = None) -> Adapter:
    """The PEFT LoRA directory ``path`` for a model of ``model_config``; LoraError naming
    what does not fit (``max_rank``: the largest rank the slots hold)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise LoraError(f"LoRA adapter {path}: not a directory")
    if not (path / CONFIG_FILE).is_file():
        raise LoraError(f"LoRA adapter {path}: not a PEFT adapter directory (no {CONFIG_FILE})")
    if not (path / WEIGHTS_FILE).is_file():
        pickled = (path / "adapter_model.bin").is_file()
        raise LoraError(f"LoRA adapter {path}: no {WEIGHTS_FILE}" + (
            " (adapter_model.bin is a pickle and is never loaded: save the adapter with "
            "safe_serialization=True)" if pickled else ""))
    config_bytes = (path / CONFIG_FILE).read_bytes()
    weight_bytes = (path / WEIGHTS_FILE).read_bytes()
    where = f"LoRA adapter {path}"
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise LoraError(f"{where}: {CONFIG_FILE} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{where}: {CONFIG_FILE} is not a JSON object")
    scaling = _check_config(config, max_rank, where)
    try:
        tensors = load_safetensors(weight_bytes)
    except Exception as exc:  # safetensors raises its own types for a corrupt header
        raise LoraError(f"{where}: {WEIGHTS_FILE} is not readable ({exc})") from None
    weights = _layer_weights(tensors, model_config, int(config["r"]), scaling, where)
    digest = hashlib.sha256(hashlib.sha256(config_bytes).digest()
                            + hashlib.sha256(weight_bytes).digest()).hexdigest()
    return Adapter(name or path.name, int(config["r"]), weights, digest)


def _check_config(config: dict, max_rank: int, where: str) -> float:
    """Refuses what is not plain LoRA on the seven projections; returns the scaling."""
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{where}: peft_type {config.get('peft_type')!r} is not supported "
                        f"(only LORA)")
    for key, value in config.items():
        if key not in _READ | _INERT and value not in (None, False, {}, [], "", 0):
            raise LoraError(f"{where}: option {key}={value!r} is not supported")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise LoraError(f"{where}: init_lora_weights={init!r} changes the base weights; save "
                        f"the adapter converted to plain LoRA")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"{where}: rank r={r!r} is not a positive integer")
    if r > max_rank:
        raise LoraError(f"{where}: rank {r} is over the executor's max LoRA rank {max_rank}")
    if not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraError(f"{where}: lora_alpha={alpha!r} is not a number")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regex or "all-linear": the keys decide
        unknown = [t for t in targets if t.rpartition(".")[2] not in MODULES]
        if unknown:
            raise LoraError(f"{where}: target modules {unknown} are not supported (only "
                            f"{', '.join(MODULES)})")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _layer_weights(tensors: dict[str, torch.Tensor], model_config: ModelConfig, r: int,
                   scaling: float, where: str) -> tuple[dict, ...]:
    """Each layer's {module: (A, B * scaling)}, every tensor checked against the base
    model's shapes."""
    arch = registry.architecture(model_config.architecture)
    shapes = {t.role: t.size(model_config) for t in arch.layer_tensors}  # (out, in)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m[3] not in MODULES or f"{m[2]}.{m[3]}" != _hf_module(arch, m[3]):
            raise LoraError(f"{where}: tensor {key} is not a LoRA weight of "
                            f"{', '.join(MODULES)} (unsupported target or option)")
        layer = int(m[1])
        if layer >= model_config.num_layers:
            raise LoraError(f"{where}: tensor {key} names layer {layer}; the model has "
                            f"{model_config.num_layers}")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise LoraError(f"{where}: tensor {key} has non-finite or non-float values")
        pairs.setdefault((layer, m[3]), {})[m[4]] = t
    layers: list[dict] = [{} for _ in range(model_config.num_layers)]
    for (layer, module), ab in sorted(pairs.items()):
        out, inp = shapes[_ROLE[module]]
        prefix = f"{LAYER_PREFIX}{layer}.{_hf_module(arch, module)}"
        for part, want in (("A", (r, inp)), ("B", (out, r))):
            if part not in ab:
                raise LoraError(f"{where}: {prefix} has no lora_{part}")
            if tuple(ab[part].shape) != want:
                raise LoraError(f"{where}: {prefix}.lora_{part} is {list(ab[part].shape)}; "
                                f"the base model needs {list(want)} (rank {r})")
        layers[layer][module] = (ab["A"].float().contiguous(),
                                 (ab["B"].float() * scaling).contiguous())
    if not any(layers):
        raise LoraError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return tuple(layers)


def _hf_module(arch, module: str) -> str:
    """``self_attn.q_proj`` for q_proj: the architecture's HF name, less ``.weight``."""
    hf = next(t.hf for t in arch.layer_tensors if t.role == _ROLE[module])
    return hf.removesuffix(".weight")


class AdapterSlots:
    """``max_loras`` slots, each empty or holding one adapter, stacked per layer and
    projection so that a step reads an adapter by its slot index:
    ``a[layer][proj]`` [max_loras, len(modules) * max_rank, in] (a slot's modules' A one
    after another, each ``rank`` rows) and ``b[layer][module]`` [max_loras, out, max_rank]
    (B, scaled, in the first ``rank`` columns). Rows of a module the adapter does not
    adapt stay zero and their B is skipped (``present``). Owned by the executor's one loop;
    which adapter goes in which slot is the caller's choice."""

    def __init__(self, model_config: ModelConfig, max_loras: int, max_rank: int,
                 dtype=torch.float32, device="cpu"):
        arch = registry.architecture(model_config.architecture)
        shapes = {t.role: t.size(model_config) for t in arch.layer_tensors}  # (out, in)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: list[Adapter | None] = [None] * max_loras

        def zeros(*size):
            return torch.zeros(size, dtype=dtype, device=device)

        self.a = [{p: zeros(max_loras, len(mods) * max_rank, shapes[_ROLE[mods[0]]][1])
                   for p, mods in PROJECTIONS.items()} for _ in range(model_config.num_layers)]
        self.b = [{m: zeros(max_loras, shapes[_ROLE[m]][0], max_rank) for m in MODULES}
                  for _ in range(model_config.num_layers)]
        # present[slot][layer][proj]: indices (into PROJECTIONS[proj]) of adapted modules.
        self.present: list[list[dict[str, tuple[int, ...]]]] = [[] for _ in range(max_loras)]
        # Each projection's output rows per module: (first row, rows), for the fused outputs.
        self.rows = {p: _row_ranges([shapes[_ROLE[m]][0] for m in mods])
                     for p, mods in PROJECTIONS.items()}

    def load(self, adapter: Adapter, slot: int) -> None:
        """Puts ``adapter`` in ``slot``, replacing what it held."""
        assert 0 <= slot < self.max_loras and adapter.rank <= self.max_rank
        self.evict(slot)
        r = adapter.rank
        for layer, modules in enumerate(adapter.weights):
            present = {}
            for proj, mods in PROJECTIONS.items():
                here = tuple(j for j, m in enumerate(mods) if m in modules)
                for j in here:
                    a, b = modules[mods[j]]
                    self.a[layer][proj][slot, j * r : (j + 1) * r] = a
                    self.b[layer][mods[j]][slot, :, :r] = b
                if here:
                    present[proj] = here
            self.present[slot].append(present)
        self.adapters[slot] = adapter

    def evict(self, slot: int) -> None:
        """Empties ``slot`` (zeroed: a stale read adds nothing)."""
        if self.adapters[slot] is None:
            return
        for layer_a, layer_b in zip(self.a, self.b, strict=True):
            for t in (*layer_a.values(), *layer_b.values()):
                t[slot].zero_()
        self.adapters[slot], self.present[slot] = None, []

    def slot_of(self, name: str) -> int | None:
        return next((i for i, a in enumerate(self.adapters) if a and a.name == name), None)


def _row_ranges(sizes: list[int]) -> tuple[tuple[int, int], ...]:
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    return tuple(zip(starts, sizes, strict=True))


class LoraBatch:
    """One step's LoRA: the slots and which token columns use which slot. Built once per
    step from ``token_slots`` [T] (a slot, or -1 for the base model, per token) and
    applied by every projection of every layer."""

    def __init__(self, slots: AdapterSlots, token_slots: torch.Tensor):
        self.slots = slots
        t = token_slots.shape[0]
        # (slot, rank, columns): None for all T columns (no gather), a slice for a
        # contiguous run (a sequence's tokens are), else an index tensor.
        self.groups: list[tuple[int, int, slice | torch.Tensor | None]] = []
        for s in torch.unique(token_slots).tolist():
            if s < 0:
                continue
            adapter = slots.adapters[s]
            assert adapter is not None, f"LoRA slot {s} is empty"
            idx = (token_slots == s).nonzero().squeeze(1)
            first, n = int(idx[0]), idx.shape[0]
            cols = (None if n == t else slice(first, first + n)
                    if int(idx[-1]) - first + 1 == n else idx)
            self.groups.append((s, adapter.rank, cols))

    def add(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [rows, T] += each token's adapter delta for projection ``proj`` (one of
        PROJECTIONS) of ``layer``, x [in, T] its input; base columns are left untouched."""
        slots = self.slots
        for s, r, cols in self.groups:
            here = slots.present[s][layer].get(proj)
            if not here:
                continue
            xs = x if cols is None else x[:, cols]  # [in, n]
            n_a = (here[-1] + 1) * r  # the A rows up to the last module adapted
            a = torch.mm(slots.a[layer][proj][s, :n_a], xs)  # [n_a, n]
            for j in here:
                first, rows = slots.rows[proj][j]
                b = slots.b[layer][PROJECTIONS[proj][j]][s, :, :r]  # [out_j, r]
                target = out[first : first + rows]
                if isinstance(cols, torch.Tensor):
                    target.index_add_(1, cols, torch.mm(b, a[j * r : (j + 1) * r]))
                else:
                    target = target if cols is None else target[:, cols]
                    target.addmm_(b, a[j * r : (j + 1) * r])

"""One-time conversion of a GGUF file into a Hugging Face directory, for any registered
architecture that declares a GGUF name map (executor_svc/models/: the caller passes it).

The output is what ``transformers`` itself would build from the file (checked token-for-token
and weight-for-weight in tests/executor/test_model_files.py): fp32 ``model.safetensors`` with
HF tensor names, ``config.json`` (the architecture's ``*ForCausalLM``), ``tokenizer.json``
(byte-level BPE) and ``tokenizer_config.json`` carrying the chat template. Nothing here
imports transformers.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from executor_svc.gguf_tokenizer import ConversionError, build_tokenizer, build_tokenizer_config
from executor_svc.models.base import Architecture


@dataclass(frozen=True)
class GGUFFile:
    """Metadata (plain Python values) and the reader holding the tensors."""

    metadata: dict
    reader: GGUFReader

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]

    def arch_key(self, name: str, default=None):
        return self.metadata.get(f"{self.arch}.{name}", default)


def read_gguf(path: pathlib.Path) -> GGUFFile:
    """Parses the header; raises ConversionError for a non-GGUF file (the architecture is
    the caller's to check: executor_svc/models/registry.py; the tokenizer convert's)."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ConversionError(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    return GGUFFile(metadata, reader)


def convert(gguf: GGUFFile, out_dir: pathlib.Path, name: str, arch: Architecture) -> None:
    """Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    tokenizer = build_tokenizer(gguf.metadata, arch)  # first: it refuses what it cannot read
    tensors = convert_weights(gguf, arch)
    config = build_config(gguf, arch, tie=("lm_head.weight" not in tensors), name=name)
    config["eos_token_id"] = end_token_ids(gguf.metadata, arch)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tok_config = build_tokenizer_config(gguf.metadata, config["max_position_embeddings"], arch)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
        + "\n"
    )


def convert_weights(gguf: GGUFFile, arch: Architecture) -> dict[str, torch.Tensor]:
    """Dequantizes every tensor to fp32 and renames it; Q/K rows get llama.cpp's rope
    permutation undone (where its converter applied one) and norm weights its offset
    (``hf_values``), so the weights equal the HF checkpoint's."""
    n_heads = gguf.arch_key("attention.head_count")
    n_kv_heads = gguf.arch_key("attention.head_count_kv", n_heads)
    out = {}
    for tensor in gguf.reader.tensors:
        name = hf_name(arch, tensor.name)
        weight = _dequantize(tensor)
        if arch.gguf_rope_permuted and name.endswith("q_proj.weight"):
            weight = _unpermute(weight, n_heads)
        elif arch.gguf_rope_permuted and name.endswith("k_proj.weight"):
            weight = _unpermute(weight, n_kv_heads)
        out[name] = torch.from_numpy(np.ascontiguousarray(hf_values(arch, name, weight),
                                                          dtype=np.float32))
    return out


def hf_values(arch: Architecture, hf_name: str, values: np.ndarray) -> np.ndarray:
    """A tensor's values as the HF checkpoint holds them: llama.cpp stores Gemma's norm
    weights with the 1 its forward adds already added (``Architecture.gguf_norm_offset``);
    taken off in fp32, as transformers' GGUF loader does, so the forward's 1 + w is
    transformers' value bit for bit."""
    if arch.gguf_norm_offset and hf_name.endswith("norm.weight"):
        return (values.astype(np.float32) - np.float32(arch.gguf_norm_offset))
    return values


def end_token_ids(meta: dict, arch: Architecture) -> int | list[int] | None:
    """config.json's eos_token_id: the file's EOS, plus the tokens that end a turn in the
    architecture's chat format (Gemma's <end_of_turn>), as llama.cpp treats them."""
    eos = meta.get("tokenizer.ggml.eos_token_id")
    tokens = meta["tokenizer.ggml.tokens"]
    extra = [tokens.index(t) for t in arch.gguf_end_tokens if t in tokens]
    ids = [i for i in [eos, *extra] if i is not None]
    return ids[0] if len(ids) == 1 else (list(dict.fromkeys(ids)) or None)


def hf_name(arch: Architecture, gguf_name: str) -> str:
    """The HF name of a GGUF tensor (ConversionError where the architecture has none)."""
    name = arch.hf_name(gguf_name)
    if name is None:
        # e.g. rope_freqs.weight (Llama 3.1 rope scaling): silently dropping it would change
        # outputs.
        raise ConversionError(f"GGUF tensor {gguf_name!r} has no {arch.name} HF equivalent")
    return name


def _dequantize(tensor) -> np.ndarray:
    # tensor.data is [rows, bytes-per-row] for quantized types; dequantize gives [rows, cols].
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.array(tensor.data, dtype=np.float32)  # copy: the reader's memmap is read-only
    return dequantize(tensor.data, tensor.tensor_type)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp stores each head's rows interleaved (pairs) for its rope; HF keeps halves.
    # w: [n_heads * head_dim, hidden] -> same shape, rows reordered.
    rows, hidden = w.shape
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, hidden).swapaxes(1, 2).reshape(rows, hidden)


def build_config(gguf: GGUFFile, arch: Architecture, tie: bool, name: str) -> dict:
    """The architecture's transformers config dict from the file's `<arch>.*` metadata."""
    meta, key = gguf.metadata, gguf.arch_key
    n_heads = key("attention.head_count")
    hidden = key("embedding_length")
    rope_theta = float(key("rope.freq_base", 10000.0))
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // n_heads
    return {
        "architectures": [arch.hf_class],
        "model_type": arch.model_types[0],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": key("context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_act": "silu",
        **arch.gguf_config,
        **(arch.gguf_extra_config(key) if arch.gguf_extra_config else {}),
        "tie_word_embeddings": tie,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "_name_or_path": name,
    }

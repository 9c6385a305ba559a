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
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from executor_svc.models.base import Architecture, PreTokenizer

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as transformers' GGUF loader sets them; any other
# value keeps GPT-2's ByteLevel regex (transformers does the same).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# An architecture adds its family's own (Architecture.gguf_pre_tokenizers).
_PRE_TOKENIZERS = {
    name: PreTokenizer(_LLAMA3_SPLIT)
    for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")
}

class ConversionError(ValueError):
    """The GGUF file describes something this converter cannot turn into an HF dir."""


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
    """Parses the header; raises ConversionError for a non-GGUF file or tokenizer (the
    architecture is the caller's to check: executor_svc/models/registry.py)."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ConversionError(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ConversionError(
            f"{path}: tokenizer {metadata.get('tokenizer.ggml.model')!r} is not supported "
            "(only byte-level BPE, 'gpt2'); convert the model to an HF directory instead"
        )
    return GGUFFile(metadata, reader)


def convert(gguf: GGUFFile, out_dir: pathlib.Path, name: str, arch: Architecture) -> None:
    """Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    tensors = convert_weights(gguf, arch)
    config = build_config(gguf, arch, tie=("lm_head.weight" not in tensors), name=name)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    build_tokenizer(gguf.metadata, arch).save(str(out_dir / "tokenizer.json"))
    tok_config = build_tokenizer_config(gguf.metadata, config["max_position_embeddings"])
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
        + "\n"
    )


def convert_weights(gguf: GGUFFile, arch: Architecture) -> dict[str, torch.Tensor]:
    """Dequantizes every tensor to fp32 and renames it; Q/K rows get llama.cpp's rope
    permutation undone (where its converter applied one) so the weights equal the HF
    checkpoint's."""
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
        out[name] = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
    return out


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
        "tie_word_embeddings": tie,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "_name_or_path": name,
    }


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table (same as transformers').
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def build_tokenizer(meta: dict, arch: Architecture) -> Tokenizer:
    """Byte-level BPE matching transformers' GGUF tokenizer (GPT2Tokenizer + control tokens)."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False)
    )
    pre = {**_PRE_TOKENIZERS, **arch.gguf_pre_tokenizers}.get(meta.get("tokenizer.ggml.pre"))
    if pre is not None and pre.nfc:
        tok.normalizer = normalizers.NFC()
    if pre is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|> ...) must stay whole; a control token spelled outside the
    # byte alphabet is a llama.cpp mislabel and is skipped, as transformers does.
    tok.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _TOKEN_TYPE_CONTROL and set(t) <= alphabet
    ])
    tok.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _TOKEN_TYPE_USER_DEFINED and t in vocab
    ])
    return tok


def build_tokenizer_config(meta: dict, max_len: int) -> dict:
    """tokenizer_config.json: special token strings, BOS/EOS flags and the chat template."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []

    def token(key: str):
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [
            t for t, kind in zip(tokens, types, strict=False) if kind == _TOKEN_TYPE_CONTROL
        ],
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config

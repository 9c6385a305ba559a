"""The architecture interface: what one model family declares so that the executor reads
its config.json, loads, splits and converts its weights without naming it anywhere else.

An ``Architecture`` is data: its Hugging Face ``model_type`` names and GGUF
``general.architecture``, how its config.json maps onto the shared ModelConfig, and one
``Tensor`` row per weight (HF name, llama.cpp's name, shape, tensor-parallel split, the
config flag it depends on). The forward pass (executor_svc/models/decoder.py) runs every
architecture the rows below describe: a pre-norm decoder with RMSNorm, rotate-half RoPE,
GQA and a SwiGLU FFN, optionally q/k/v biases and per-head q/k RMSNorm. Torch-free:
executor_svc/model_files.py's command line checks a model_type through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from executor_svc.model_config import ModelConfig

LAYER_PREFIX, GGUF_LAYER_PREFIX = "model.layers.", "blk."
# GGUF's tokenizer.ggml.model values: byte-level BPE; SentencePiece (llama.cpp names it after
# the family it first served).
GGUF_BYTE_LEVEL, GGUF_SENTENCEPIECE = "gpt2", "llama"


@dataclass(frozen=True)
class Split:
    """A tensor-parallel rank keeps, along ``dim``, the rows of its ShardLayout range ``by``:
    ``q_heads`` / ``kv_heads`` (times head_dim), ``ffn`` or ``vocab``."""

    dim: int
    by: str


ROWS_BY_Q_HEAD, COLUMNS_BY_Q_HEAD = Split(0, "q_heads"), Split(1, "q_heads")
ROWS_BY_KV_HEAD = Split(0, "kv_heads")
ROWS_BY_FFN, COLUMNS_BY_FFN = Split(0, "ffn"), Split(1, "ffn")
ROWS_BY_VOCAB = Split(0, "vocab")


@dataclass(frozen=True)
class Tensor:
    """One weight: ``role`` is what the forward pass calls it; ``hf`` / ``gguf`` its names
    (inside ``model.layers.N.`` / ``blk.N.`` for a layer's); ``shape`` in ModelConfig sizes
    (h hidden, i FFN, v vocabulary, d head_dim, q Hq * d, kv Hkv * d); ``split`` None: every
    rank holds it whole; ``when``: the checkpoint has it only if this holds for the config."""

    role: str
    hf: str
    gguf: str
    shape: tuple[str, ...]
    split: Split | None = None
    when: Callable[[ModelConfig], bool] | None = None

    def present(self, config: ModelConfig) -> bool:
        return self.when is None or self.when(config)

    def size(self, config: ModelConfig) -> tuple[int, ...]:
        c = config
        sizes = {"h": c.hidden_size, "i": c.intermediate_size, "v": c.vocab_size,
                 "d": c.head_dim, "q": c.num_heads * c.head_dim, "kv": c.num_kv_heads * c.head_dim}
        return tuple(sizes[s] for s in self.shape)


def _untied(c: ModelConfig) -> bool:
    return not c.tie_word_embeddings


def _biased(c: ModelConfig) -> bool:
    return c.qkv_bias


def _qk_normed(c: ModelConfig) -> bool:
    return c.qk_norm


GLOBAL_TENSORS = (
    Tensor("embed", "model.embed_tokens.weight", "token_embd.weight", ("v", "h"), ROWS_BY_VOCAB),
    Tensor("norm", "model.norm.weight", "output_norm.weight", ("h",)),
    Tensor("lm_head", "lm_head.weight", "output.weight", ("v", "h"), ROWS_BY_VOCAB, _untied),
)
# The layer every architecture here shares (HF and llama.cpp use these names for all of them).
DECODER_LAYER = (
    Tensor("attn_norm", "input_layernorm.weight", "attn_norm.weight", ("h",)),
    Tensor("q", "self_attn.q_proj.weight", "attn_q.weight", ("q", "h"), ROWS_BY_Q_HEAD),
    Tensor("k", "self_attn.k_proj.weight", "attn_k.weight", ("kv", "h"), ROWS_BY_KV_HEAD),
    Tensor("v", "self_attn.v_proj.weight", "attn_v.weight", ("kv", "h"), ROWS_BY_KV_HEAD),
    Tensor("o", "self_attn.o_proj.weight", "attn_output.weight", ("h", "q"), COLUMNS_BY_Q_HEAD),
    Tensor("ffn_norm", "post_attention_layernorm.weight", "ffn_norm.weight", ("h",)),
    Tensor("gate", "mlp.gate_proj.weight", "ffn_gate.weight", ("i", "h"), ROWS_BY_FFN),
    Tensor("up", "mlp.up_proj.weight", "ffn_up.weight", ("i", "h"), ROWS_BY_FFN),
    Tensor("down", "mlp.down_proj.weight", "ffn_down.weight", ("h", "i"), COLUMNS_BY_FFN),
)
QKV_BIASES = (
    Tensor("q_bias", "self_attn.q_proj.bias", "attn_q.bias", ("q",), ROWS_BY_Q_HEAD, _biased),
    Tensor("k_bias", "self_attn.k_proj.bias", "attn_k.bias", ("kv",), ROWS_BY_KV_HEAD, _biased),
    Tensor("v_bias", "self_attn.v_proj.bias", "attn_v.bias", ("kv",), ROWS_BY_KV_HEAD, _biased),
)
QK_NORMS = (
    Tensor("q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight", ("d",), None, _qk_normed),
    Tensor("k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight", ("d",), None, _qk_normed),
)
_ROPE_TYPES = (None, "default", "llama3")


@dataclass(frozen=True)
class PreTokenizer:
    """How a GGUF's ``tokenizer.ggml.pre`` splits text before BPE (a regex, as its HF
    tokenizer.json has it), and whether that tokenizer normalizes to NFC first."""

    split: str
    nfc: bool = False


@dataclass(frozen=True)
class Architecture:
    """One model family. ``config_fields(raw)``: the ModelConfig fields particular to it
    (qkv_bias, qk_norm) from config.json, ValueError for a variant it cannot serve.
    ``gguf_arch`` None: no GGUF conversion; ``gguf_rope_permuted``: llama.cpp stored the
    q/k rows interleaved for its RoPE (its llama converter does; qwen2/qwen3's do not);
    ``gguf_config``: what a conversion's config.json adds to the shared keys, as
    transformers writes them; ``gguf_pre_tokenizers``: the ``tokenizer.ggml.pre`` values
    of its family's tokenizers the converter does not know (executor_svc/gguf_convert.py).
    ``native_decoder``: kernels/cpu_decoder.cpp can run its
    layers (no biases, no q/k norms); otherwise every step takes the per-op path.
    A GGUF family's own conventions (executor_svc/gguf_convert.py, gguf_tokenizer.py):
    ``gguf_sentencepiece``: its files' SentencePiece ("llama") tokenizer is read in the
    family's form; ``gguf_norm_offset``: llama.cpp stored norm weights with this added;
    ``gguf_chat_template``: the template for files that carry none; ``gguf_end_tokens``:
    tokens that also end generation (the chat format's end of turn);
    ``gguf_extra_config(key)``: config.json entries computed from the file's
    ``<arch>.*`` metadata (``key(name, default)``)."""

    name: str
    model_types: tuple[str, ...]
    hf_class: str
    layer_tensors: tuple[Tensor, ...]
    config_fields: Callable[[dict], dict]
    global_tensors: tuple[Tensor, ...] = GLOBAL_TENSORS
    gguf_arch: str | None = None
    gguf_rope_permuted: bool = False
    gguf_config: dict = field(default_factory=dict)
    gguf_pre_tokenizers: dict[str, PreTokenizer] = field(default_factory=dict)
    native_decoder: bool = False
    gguf_sentencepiece: bool = False
    gguf_norm_offset: float = 0.0
    gguf_chat_template: str | None = None
    gguf_end_tokens: tuple[str, ...] = ()
    gguf_extra_config: Callable[[Callable], dict] | None = None

    def read_config(self, raw: dict, name: str) -> ModelConfig:
        """config.json (parsed) -> ModelConfig; ValueError for what cannot be served. The
        architecture's ``config_fields`` may replace any shared field."""
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"{name}: RoPE scaling {rope_type!r} is not supported "
                             f"(supported: default, llama3)")
        eos = raw.get("eos_token_id")
        fields = dict(
            architecture=self.name,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            name=raw.get("_name_or_path") or name,
            layer_windows=layer_windows(raw),
        )
        return ModelConfig(**{**fields, **self.config_fields(raw)})

    def tensors(self, config: ModelConfig) -> Iterator[tuple[str, Tensor]]:
        """(HF name, row) of every tensor a checkpoint of ``config`` holds."""
        for t in self.global_tensors:
            if t.present(config):
                yield t.hf, t
        for i in range(config.num_layers):
            for t in self.layer_tensors:
                if t.present(config):
                    yield f"{LAYER_PREFIX}{i}.{t.hf}", t

    def tensor_named(self, hf_name: str) -> Tensor | None:
        """The row of an HF tensor name (any layer), or None (not one of ours)."""
        if hf_name.startswith(LAYER_PREFIX):
            return self._by_hf.get(hf_name[len(LAYER_PREFIX):].partition(".")[2])
        return self._globals_by_hf.get(hf_name)

    def hf_name(self, gguf_name: str) -> str | None:
        """llama.cpp's tensor name -> the HF one, or None when this architecture has none."""
        if gguf_name.startswith(GGUF_LAYER_PREFIX):
            layer, _, suffix = gguf_name[len(GGUF_LAYER_PREFIX):].partition(".")
            t = self._by_gguf.get(suffix)
            return None if t is None or not layer.isdigit() else f"{LAYER_PREFIX}{layer}.{t.hf}"
        t = self._globals_by_gguf.get(gguf_name)
        return None if t is None else t.hf

    @functools.cached_property
    def _by_hf(self) -> dict[str, Tensor]:
        return {t.hf: t for t in self.layer_tensors}

    @functools.cached_property
    def _by_gguf(self) -> dict[str, Tensor]:
        return {t.gguf: t for t in self.layer_tensors}

    @functools.cached_property
    def _globals_by_hf(self) -> dict[str, Tensor]:
        return {t.hf: t for t in self.global_tensors}

    @functools.cached_property
    def _globals_by_gguf(self) -> dict[str, Tensor]:
        return {t.gguf: t for t in self.global_tensors}


def layer_windows(raw: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) from config.json: its
    ``layer_types``, or Qwen2's older ``use_sliding_window`` / ``max_window_layers``."""
    layers, window = raw["num_hidden_layers"], raw.get("sliding_window")
    types = raw.get("layer_types")
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    if raw.get("use_sliding_window") and window:
        first = raw.get("max_window_layers", 0)
        return tuple(window if i >= first else None for i in range(layers))
    return (None,) * layers


def refuse(raw: dict, name: str, *keys: str) -> None:
    """ValueError if config.json turns on any of ``keys`` (features this forward lacks)."""
    on = [k for k in keys if raw.get(k)]
    if on:
        raise ValueError(f"{name}: {', '.join(on)} is not supported by this executor")

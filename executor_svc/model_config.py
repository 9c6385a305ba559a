"""What a model's ``config.json`` says, in the one shape every architecture maps onto: the
type that both the forward pass (executor_svc/models/decoder.py) and the tensor-parallel
split (executor_svc/tp_shard.py) need, so it sits below both. Reading a config.json is the
architecture's (executor_svc/models/base.py); this module only holds the result."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The fields of a decoder-only transformer this forward pass needs."""

    architecture: str  # the registry's name for it (executor_svc/models/registry.py)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # may differ from hidden_size / num_heads
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # "llama3" frequency scaling, else None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    name: str
    qkv_bias: bool = False  # q_proj, k_proj and v_proj carry a bias (o_proj never does)
    qk_norm: bool = False  # an RMSNorm over each q and k head (weights [head_dim]) before RoPE
    # Per layer, the sliding attention window in tokens, or None for full attention; empty:
    # every layer full. Each layer's attention call takes its own (kernels/attention.py).
    layer_windows: tuple[int | None, ...] = ()
    # Per layer, its RoPE base where layers differ (Gemma 3: 10k on the windowed ones, 1M on
    # the global ones); empty: rope_theta everywhere. rope_scaling applies to rope_theta's.
    layer_rope_thetas: tuple[float, ...] = ()
    hidden_act: str = "silu"  # the gated FFN's activation: "silu" or "gelu_tanh"
    embed_scale: float | None = None  # the embeddings are multiplied by this (Gemma: sqrt H)
    attn_scale: float | None = None  # the attention's q.k scale; None: 1 / sqrt(head_dim)
    # The checkpoint's RMSNorm weights w act as norm_offset + w (Gemma's 1 + w).
    norm_offset: float = 0.0
    # Each layer also normalizes its attention and FFN outputs before adding them (Gemma).
    sandwich_norms: bool = False

    @property
    def kv_window(self) -> int:
        """The widest layer window where every layer has one, else 0: KV further back
        than this is read by no layer (what the scheduler may release)."""
        windows = self.layer_windows
        return max(windows) if windows and all(windows) else 0

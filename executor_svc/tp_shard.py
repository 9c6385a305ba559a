"""Which slice of the model each tensor-parallel rank holds, and loading only that slice.

Megatron-style split of a decoder layer over N ranks; each architecture declares its
tensors' splits (executor_svc/models/base.py, ``Tensor.split``), for every one here:

| tensor                 | split                   | joined by                   |
|------------------------|-------------------------|-----------------------------|
| q_proj, k_proj, v_proj | rows, by head (column-  | nothing: attention is local |
| (and their biases)     | parallel)               | to a rank's heads           |
| o_proj                 | columns, by query head  | all-reduce (sum)            |
| gate_proj, up_proj     | rows (column-parallel)  | nothing: SiLU is elementwise|
| down_proj              | columns (row-parallel)  | all-reduce (sum)            |
| embed_tokens           | vocabulary rows         | all-reduce (one rank owns   |
|                        |                         | each id, the rest add 0)    |
| lm_head                | vocabulary rows         | gather of logits to rank 0  |
| norms (q/k norms too)  | replicated              |                             |

Heads are split by GQA group, so a query head and its KV head always share a rank:

* N <= KV heads: each rank takes a contiguous run of whole groups, as even as possible
  (SmolLM2's 3 KV heads over 2 ranks: 1 and 2). No KV head is stored twice; every rank's
  KV pool is sized by the largest share so block ids mean the same on every rank.
* N > KV heads: ranks split a group's query heads, each holding a replica of its KV head
  (as vLLM). Needs ceil(N / KV heads) <= query heads per group.

Uneven splits, not zero-head padding: padding computes and caches heads that do nothing.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch
from safetensors import safe_open

from executor_svc.model_config import ModelConfig
from executor_svc.models.base import Architecture


@dataclass(frozen=True)
class ShardLayout:
    """The split of one model over ``tp_size`` ranks, seen from ``rank``.

    The ``*_by_rank`` tuples hold a contiguous ``range`` per rank: query heads, KV heads,
    FFN (intermediate) rows and vocabulary rows. Every query head is on exactly one rank;
    a KV head is on every rank that holds one of its query heads.
    """

    tp_size: int
    rank: int
    q_heads_by_rank: tuple[range, ...]
    kv_heads_by_rank: tuple[range, ...]
    ffn_by_rank: tuple[range, ...]
    vocab_by_rank: tuple[range, ...]

    @property
    def q_heads(self) -> range:
        return self.q_heads_by_rank[self.rank]

    @property
    def kv_heads(self) -> range:
        return self.kv_heads_by_rank[self.rank]

    @property
    def ffn(self) -> range:
        return self.ffn_by_rank[self.rank]

    @property
    def vocab(self) -> range:
        return self.vocab_by_rank[self.rank]

    @property
    def max_kv_heads(self) -> int:
        """KV heads of the largest share: sizes every rank's pool to the same block count."""
        return max(len(r) for r in self.kv_heads_by_rank)

    @property
    def max_vocab(self) -> int:
        """Rows of the widest vocabulary slice: logits slices are padded to it to gather."""
        return max(len(r) for r in self.vocab_by_rank)


def _even(n: int, parts: int, i: int) -> range:
    return range(i * n // parts, (i + 1) * n // parts)


def split_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) per rank; raises ValueError when no exact split exists."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv = [_even(num_kv_heads, tp_size, r) for r in range(tp_size)]
        return [(range(k.start * group, k.stop * group), k) for k in kv]
    # More ranks than KV heads: rank r serves group r * Hkv // N, with its peers.
    owner = [r * num_kv_heads // tp_size for r in range(tp_size)]
    if max(owner.count(j) for j in range(num_kv_heads)) > group:
        raise ValueError(
            f"--tp-size {tp_size} leaves a rank without a query head: the model has "
            f"{num_heads} query heads in {num_kv_heads} groups of {group}"
        )
    split = []
    for r, j in enumerate(owner):
        peers = [p for p, g in enumerate(owner) if g == j]
        q = _even(group, len(peers), peers.index(r))
        split.append((range(j * group + q.start, j * group + q.stop), range(j, j + 1)))
    return split


def shard_layout(config: ModelConfig, tp_size: int, rank: int) -> ShardLayout:
    """Raises ValueError (a user error: the model cannot be split this way)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside tp_size {tp_size}")
    if config.intermediate_size < tp_size:
        raise ValueError(f"--tp-size {tp_size} exceeds the FFN width {config.intermediate_size}")
    heads = split_heads(config.num_heads, config.num_kv_heads, tp_size)
    return ShardLayout(
        tp_size=tp_size,
        rank=rank,
        q_heads_by_rank=tuple(q for q, _ in heads),
        kv_heads_by_rank=tuple(kv for _, kv in heads),
        ffn_by_rank=tuple(_even(config.intermediate_size, tp_size, r) for r in range(tp_size)),
        vocab_by_rank=tuple(_even(config.vocab_size, tp_size, r) for r in range(tp_size)),
    )


def _slice_of(name: str, arch: Architecture, layout: ShardLayout,
              head_dim: int) -> tuple[int, range] | None:
    """(dimension, index range) of checkpoint tensor ``name`` this rank keeps; None: all."""
    tensor = arch.tensor_named(name)
    if tensor is None or tensor.split is None:
        return None
    part = getattr(layout, tensor.split.by)
    if tensor.split.by in ("q_heads", "kv_heads"):
        part = range(part.start * head_dim, part.stop * head_dim)
    return tensor.split.dim, part


def load_shard(path: pathlib.Path, config: ModelConfig, layout: ShardLayout,
               arch: Architecture) -> dict:
    """This rank's slice of every checkpoint tensor, read slice by slice from the
    safetensors files (a rank never holds the whole model in memory)."""
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                part = _slice_of(name, arch, layout, config.head_dim)
                if part is None:
                    weights[name] = f.get_tensor(name)
                elif part[0] == 0:
                    weights[name] = f.get_slice(name)[part[1].start : part[1].stop]
                else:
                    weights[name] = f.get_slice(name)[:, part[1].start : part[1].stop]
    return {name: t.contiguous() for name, t in weights.items()}


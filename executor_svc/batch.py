"""Per-sequence state the executor keeps between steps, and flattening a step into tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.sampler import SamplingConfig
from kernels.attention import AttentionMetadata


@dataclass
class SequenceState:
    """One sequence as the executor holds it (the scheduler holds the authoritative copy).

    Invariants: num_computed <= len(token_ids); the block table covers every computed
    position; token_ids[-1] is the last sampled token once the prompt is done, and the
    scheduler's next decode delta computes it.
    """

    seq_id: int
    token_ids: list[int]  # prompt, then every generated token
    num_computed: int  # tokens whose K/V is in the cache
    block_table: list[int]  # device block ids, in position order
    sampling: SamplingConfig
    num_prompt_tokens: int
    seed: int  # request seed, or a random one drawn when the sequence arrived

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)


@dataclass(frozen=True)
class StepInputs:
    """One step flattened: T scheduled tokens across all sequences, S of them sampling."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64, last row of each sequence that completes
    sampling_seqs: list[SequenceState]  # [S], parallel to sample_rows


def build_inputs(
    scheduled: list[tuple[SequenceState, int]], block_size: int, device="cpu"
) -> StepInputs:
    """``scheduled``: (sequence, tokens to compute from its num_computed), each n >= 1.

    A sequence samples when this step brings num_computed up to num_tokens (DESIGN.md §2):
    the same rule covers a prompt's last chunk, a decode and a recompute.
    """
    ids, positions, slots, sample_rows, sampling = [], [], [], [], []
    row = 0
    for seq, n in scheduled:
        start = seq.num_computed
        pos = np.arange(start, start + n, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        ids.extend(seq.token_ids[start : start + n])
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        row += n
        if start + n == seq.num_tokens:
            sample_rows.append(row - 1)
            sampling.append(seq)
    meta = AttentionMetadata.build(
        query_lens=[n for _, n in scheduled],
        context_lens=[seq.num_computed + n for seq, n in scheduled],
        block_tables=[seq.block_table for seq, _ in scheduled],
        block_size=block_size,
        device=device,
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(np.concatenate(positions)).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        meta=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
        sampling_seqs=sampling,
    )

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
    guide: object = None  # its structured-output matcher (executor_svc/guided.py), lazily
    # Set once its own per-row work failed (executor_svc/sampler.py RowFailure): it then
    # samples a placeholder until a plan drops it (its request has ended with an error).
    failure: object = None
    fault: str = ""  # test-only: the stage that fails for it (executor_svc/faults.py)

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

    A sequence samples when this step brings num_computed up to num_tokens (docs/design.md §2):
    the same rule covers a prompt's last chunk, a decode and a recompute.

    Per-row work is numpy over the whole step, not Python per token: this runs every step
    (64 decodes: 1.3 ms as a per-sequence loop, ~0.4 ms like this).
    """
    num_seqs = len(scheduled)
    query_lens = [n for _, n in scheduled]
    computed = np.fromiter((seq.num_computed for seq, _ in scheduled), np.int64, num_seqs)
    lens = np.asarray(query_lens, dtype=np.int64)  # [B]
    ends = np.cumsum(lens)  # [B] one past each sequence's last row
    width = max(seq.num_blocks for seq, _ in scheduled)
    tables = np.zeros((num_seqs, max(width, 1)), dtype=np.int64)  # [B, nb], 0-padded
    ids: list[int] = []
    for i, (seq, n) in enumerate(scheduled):
        tables[i, : seq.num_blocks] = seq.block_table
        ids.extend(seq.token_ids[seq.num_computed : seq.num_computed + n])
    seq_of_row = np.repeat(np.arange(num_seqs), lens)  # [T]
    positions = np.arange(int(ends[-1]), dtype=np.int64) - (ends - lens - computed)[seq_of_row]
    slots = tables[seq_of_row, positions // block_size] * block_size + positions % block_size
    sampling = [seq for seq, n in scheduled if seq.num_computed + n == seq.num_tokens]
    sample_rows = [int(end) - 1 for (seq, n), end in zip(scheduled, ends, strict=True)
                   if seq.num_computed + n == seq.num_tokens]
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    starts[1:] = ends
    meta = AttentionMetadata(
        query_lens=tuple(query_lens),
        context_lens=tuple((computed + lens).tolist()),
        query_start=torch.from_numpy(starts).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        block_size=block_size,
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        meta=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
        sampling_seqs=sampling,
    )

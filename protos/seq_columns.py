"""Seq-id columns as bytes (protos/continuum/v1/executor.proto): a plan's running
sequences (``BatchPlan.packed_cached_seq_ids``) and an answer's sampled ones
(``StepResult.packed_seq_ids``).

Each id is 8 little-endian bytes. The scheduler's core packs a plan's column once, as it
freezes the plan (scheduler_svc/core/plan.py), and the ids it expects back from the same
bytes; the executor unpacks the plan's in one call and packs the ids that sampled; the
scheduler checks an answer by comparing the two byte strings, without reading an id (at
256 running sequences that check and the ids' conversion cost ~12 µs a step as lists of
ints). Standard library only: the scheduler's core imports it.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable

ID_BYTES = 8
_SWAP = sys.byteorder != "little"


def pack(seq_ids: Iterable[int]) -> bytes:
    """``seq_ids`` as a packed column."""
    column = array.array("Q", seq_ids)
    if _SWAP:
        column.byteswap()
    return column.tobytes()


def unpack(packed: bytes) -> list[int]:
    """A packed column's ids; its length must be a multiple of ``ID_BYTES``."""
    column = array.array("Q")
    column.frombytes(packed)
    if _SWAP:
        column.byteswap()
    return column.tolist()

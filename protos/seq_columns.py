"""Seq-id columns as bytes: ``StepResult.packed_seq_ids`` (protos/continuum/v1/executor.proto).

Each id is 8 little-endian bytes. The executor packs the ids of the sequences that
sampled; the scheduler packs the ids it expects as it plans the step
(scheduler_svc/core/plan.py) and checks an answer by comparing the two byte strings,
without reading an id (at 256 running sequences that check and the ids' conversion cost
~12 µs a step as lists of ints). Standard library only: the scheduler's core imports it.
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

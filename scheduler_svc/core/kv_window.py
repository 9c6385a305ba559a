"""Sliding windows and the KV pool: what a window lets the block manager give back.

Where every layer attends to at most ``window`` trailing positions, a block wholly before
the window of the earliest query a sequence can still make holds KV no layer reads again.
Growing a sequence's table releases such blocks (as ``free`` would: a hashed one stays
cached). Their entries stay in the table, so positions keep their indices and the
executor's copy of the table (sent as appends) stays the same; every attention kernel
reads only a row's window (kernels/attention.py), so those entries are never read,
whoever owns the block now. A sequence then holds at most ``max_live`` blocks, what
admission and the pool-size checks ask for (``BlockManager.blocks_needed``).
"""

from __future__ import annotations


class KVWindow:
    """A window of ``window`` tokens (> 0) over a pool of ``num_blocks`` blocks of
    ``block_size``. ``step_cap``: the scheduler computes no more than that for one
    sequence in a step, so that its span fits the pool (``max_step_tokens``, the most
    one step computes for a sequence, or less; where even one token's span does not
    fit, a sequence is bounded by the pool as without a window). ``max_live``: the most
    blocks a sequence then holds at once."""

    __slots__ = ("window", "block_size", "step_cap", "max_live")

    def __init__(self, window: int, num_blocks: int, block_size: int,
                 max_step_tokens: int = 0) -> None:
        assert window > 0
        self.window = window
        self.block_size = block_size
        fits = (num_blocks - 1) * block_size - window  # largest step whose span fits
        self.step_cap = max(1, min(max_step_tokens, fits) if max_step_tokens else fits)
        self.max_live = -(-(window + self.step_cap) // block_size) + 1

    def behind(self, first_query: int) -> int:
        """How many leading blocks of a table lie wholly before the window of a query at
        ``first_query`` (one position more is kept than the window reads); negative
        early on."""
        return (first_query - self.window) // self.block_size

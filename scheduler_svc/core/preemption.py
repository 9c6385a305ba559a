"""Who to preempt, and how: recompute or swap, from a measured cost model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from scheduler_svc.core.request import Request


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What the executor measured at start (its Hello)."""

    prefill_tokens_per_s: float = 0.0
    swap_bytes_per_s: float = 0.0
    block_bytes: int = 0

    def prefers_swap(self, num_computed_tokens: int, num_blocks: int) -> bool:
        """Swap when copying the KV out and back costs less than re-prefilling it."""
        if self.swap_bytes_per_s <= 0 or self.block_bytes <= 0:
            return False
        if self.prefill_tokens_per_s <= 0:
            return True
        recompute_s = num_computed_tokens / self.prefill_tokens_per_s
        swap_s = 2 * num_blocks * self.block_bytes / self.swap_bytes_per_s
        return swap_s < recompute_s


def priority_key(req: Request) -> tuple[int, int]:
    """Smaller is more important: tier, then earlier admission."""
    return (req.priority_tier, req.admit_seq)


def victim_key(req: Request) -> tuple[int, bool, int]:
    """Larger is preempted first: lower tier, then a sequence whose client has seen no
    token yet (preempting it costs only time to first token, while preempting a decode
    stalls a stream mid-answer), then the most recently admitted."""
    silent = req.num_output_tokens == 0 and req.num_resumed_output_tokens == 0
    return (req.priority_tier, silent, req.admit_seq)


def pick_victim(running: list[Request], needy: Request, step: int,
                key: Callable[[Request], tuple] = victim_key) -> Request:
    """The sequence to preempt among ``needy`` and those running that have not been
    scheduled this step (``running`` is in priority order): the largest ``key`` (the
    policy's victim order; by default ``victim_key``).

    Protected sequences are passed over while any other choice exists.
    """
    candidates = [r for r in running if r.scheduled_step != step and r is not needy]
    candidates.append(needy)
    unprotected = [r for r in candidates if not r.protected]
    return max(unprotected or candidates, key=key)

"""Who to preempt, and how: recompute or swap, from a measured cost model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

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
    return (req.priority_tier, _silent(req), req.admit_seq)


def _silent(req: Request) -> bool:
    return req.num_output_tokens == 0 and req.num_resumed_output_tokens == 0


def in_victim_order(running: list[Request], lo: int,
                    key: Callable[[Request], tuple] = victim_key) -> Iterator[Request]:
    """``running[lo:]`` (in priority order: tier, then admission), largest ``key`` first.
    For the default key, lazily: the worst tier's silent sequences, latest admitted
    first, then the rest of that tier likewise, then the next tier; a caller that
    stops after a victim or two reads no key of the others (sorting them all costs
    ~50 µs at 256 running)."""
    if key is not victim_key:
        yield from sorted(running[lo:], key=key, reverse=True)
        return
    hi = len(running)
    while hi > lo:
        tier = running[hi - 1].priority_tier
        start = hi - 1
        while start > lo and running[start - 1].priority_tier == tier:
            start -= 1
        heard: list[Request] = []  # the tier's sequences whose client has seen a token
        for i in range(hi - 1, start - 1, -1):
            req = running[i]
            if _silent(req):
                yield req
            else:
                heard.append(req)
        yield from heard
        hi = start


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

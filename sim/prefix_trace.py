"""Token contents for a length-only trace: shared system prompts and multi-turn chats.

The Azure trace has lengths, not token ids, and prefix caching needs ids. ``with_prefixes``
keeps every length and arrival and decides the contents (docs/simulator.md §10):
continuations of an earlier request that fits (``continuation_share``, within ``window``
arrivals, at least ``think_s`` earlier), else one of ``SYSTEM_PROMPT_LENS`` system prompts
drawn Zipf 1/k (``system_share``), else fresh ids. Deterministic in ``seed``.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Sequence

from sim.engine import SAMPLED
from sim.workload import TraceRequest

SYSTEM_PROMPT_LENS = (128, 256, 384, 512, 768, 1024, 1536, 2048)
_SPAN = 128253  # ids 3..128255, valid for the Llama-3 vocabulary


def _fresh(rng: random.Random, n: int) -> list[int]:
    base = rng.randrange(_SPAN)
    return [3 + (base + j * 7919) % _SPAN for j in range(n)]


def system_prompt(k: int, length: int) -> list[int]:
    return [3 + (k * 104729 + j * 31) % _SPAN for j in range(length)]


@dataclasses.dataclass
class PrefixStats:
    requests: int = 0
    with_system_prompt: int = 0
    continuations: int = 0
    shared_tokens: int = 0  # prompt tokens another request had first (an upper bound on hits)
    prompt_tokens: int = 0

    def line(self) -> str:
        n = max(1, self.requests)
        shared = 100 * self.shared_tokens / max(1, self.prompt_tokens)
        return (f"{self.requests} requests: {100 * self.with_system_prompt / n:.0f} % open "
                f"with a shared system prompt, {100 * self.continuations / n:.0f} % continue "
                f"an earlier conversation; {shared:.0f} % of prompt tokens are shared")


def with_prefixes(requests: Sequence[TraceRequest], system_share: float = 0.5,
                  continuation_share: float = 0.3, think_s: float = 5.0, window: int = 256,
                  system_lens: Sequence[int] = SYSTEM_PROMPT_LENS, seed: int = 0,
                  ) -> tuple[list[TraceRequest], PrefixStats]:
    """``requests`` (sorted by arrival) with ``prompt_ids`` set; lengths unchanged."""
    if not (0 <= system_share <= 1 and 0 <= continuation_share <= 1):
        raise ValueError("system_share and continuation_share must be in [0, 1]")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(len(system_lens))]
    recent: deque[tuple[float, tuple[int, ...], int]] = deque(maxlen=window)
    stats, out = PrefixStats(), []
    for req in requests:
        n = req.num_prompt_tokens
        ids: list[int] | None = None
        stats.requests += 1
        stats.prompt_tokens += n
        if rng.random() < continuation_share:
            fits = [r for r in recent if r[0] <= req.arrival_s - think_s
                    and len(r[1]) + r[2] < n]
            if fits:
                _, prev, prev_out = rng.choice(fits)
                ids = [*prev, *([SAMPLED] * prev_out)]
                stats.continuations += 1
                stats.shared_tokens += len(ids)
                ids += _fresh(rng, n - len(ids))
        if ids is None and rng.random() < system_share:
            k = rng.choices(range(len(system_lens)), weights)[0]
            if system_lens[k] < n:
                ids = system_prompt(k, system_lens[k]) + _fresh(rng, n - system_lens[k])
                stats.with_system_prompt += 1
                stats.shared_tokens += system_lens[k]
        if ids is None:
            ids = _fresh(rng, n)
        prompt = tuple(ids)
        recent.append((req.arrival_s, prompt, req.num_output_tokens))
        out.append(dataclasses.replace(req, prompt_ids=prompt))
    return out, stats

"""Workloads for the simulator: trace replay and synthetic request classes.

A trace row gives an arrival time and the prompt and output lengths. Token
contents are optional (``prompt_ids``): without them a request shares no prefix
with any other; ``sim.prefix_trace`` synthesizes shared ones.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

# default_trace is re-exported: benchmarks.bench_scheduler imports it from here.
from sim.data import default_trace, read_trace

__all__ = ["TraceRequest", "default_trace", "load_trace", "merge", "poisson_class",
           "split_classes"]


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay: lengths in tokens, arrival in seconds from the start."""

    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    klass: str = "default"
    priority_tier: int = 1
    tenant: str = "default"
    prompt_ids: tuple[int, ...] | None = None  # None: ids unique to this request


def load_trace(path: Path, rate_scale: float = 1.0, duration_s: float | None = None,
               klass: str = "default", priority_tier: int = 1,
               tenant: str = "default") -> list[TraceRequest]:
    """The trace's rows (``sim.data.read_trace``) as requests, sorted by arrival.

    ``rate_scale`` compresses time (2.0 = twice the offered load, same length mix);
    ``duration_s`` keeps the arrivals of the first seconds *after* scaling. Raises
    ``sim.data.TraceError`` for a file that cannot be used.
    """
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    out = []
    for arrived_at, prompt, output in read_trace(path):
        arrival = arrived_at / rate_scale
        if duration_s is None or arrival < duration_s:
            out.append(TraceRequest(arrival, prompt, output, klass, priority_tier, tenant))
    out.sort(key=lambda r: r.arrival_s)
    return out


def poisson_class(rate_per_s: float, duration_s: float, prompt_tokens: int,
                  output_tokens: int, klass: str, priority_tier: int,
                  tenant: str | None = None, seed: int = 0,
                  jitter: float = 0.5) -> list[TraceRequest]:
    """Poisson arrivals of one synthetic class; lengths uniform in ±``jitter`` × mean."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while rate_per_s > 0:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            break
        p = max(1, round(prompt_tokens * rng.uniform(1 - jitter, 1 + jitter)))
        o = max(1, round(output_tokens * rng.uniform(1 - jitter, 1 + jitter)))
        out.append(TraceRequest(t, p, o, klass, priority_tier, tenant or klass))
    return out


def split_classes(requests: Sequence[TraceRequest],
                  shares: Sequence[tuple[str, int, float]], seed: int = 0) -> list[TraceRequest]:
    """Labels each request with a class drawn by ``shares``: (class, tier, weight);
    each class is its own tenant."""
    rng = random.Random(seed)
    names = [s[0] for s in shares]
    weights = [s[2] for s in shares]
    tiers = {s[0]: s[1] for s in shares}
    out = []
    for req in requests:
        name = rng.choices(names, weights)[0]
        out.append(dataclasses.replace(req, klass=name, priority_tier=tiers[name], tenant=name))
    return out


def merge(*streams: Iterable[TraceRequest]) -> list[TraceRequest]:
    out = [r for s in streams for r in s]
    out.sort(key=lambda r: r.arrival_s)
    return out

"""``continuum capacity audit --from-profile PROFILE``: a partitioned contract screened
against what this machine's fitted executor profile says it serves.

A fitted profile (``python -m benchmarks.fit_profile``, read by
``sim.profile.ExecutorProfile``) says how long a step with B decodes and a C-token
prefill chunk takes here. At the contract's iteration period T and its declared
prefill:decode split, the largest step that still fits in T gives what the machine
serves: Rp = C ÷ T prompt tokens/s and Rd = B ÷ T decode tokens/s (each decode reads
the workload's mean context). The audit then runs on those partitions instead of the
declared ones; a declared budget over the served one is said in a note.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from continuum.capacity.contract import Contract, RequestClass
from continuum.capacity.partitioned import exact
from sim.profile import ExecutorProfile

MAX_TOKENS_PER_STEP = 1 << 16


@dataclasses.dataclass(frozen=True)
class Served:
    """What the profile serves at the contract's iteration period."""

    decodes: int  # per iteration
    prefill_tokens: int  # per iteration
    context: int  # mean KV tokens each decode reads
    step_ms: float  # the profile's time for that step

    def partitions(self, iteration_ms) -> tuple[Fraction, Fraction]:
        per_s = 1000 / exact(iteration_ms)
        return self.prefill_tokens * per_s, self.decodes * per_s


def _mean_context(classes: tuple[RequestClass, ...]) -> int:
    """Mean context a decoding sequence holds: its prompt plus half its output, weighted
    by the time each class spends decoding (rate × output tokens)."""
    weight = sum(exact(c.rate_per_s) * c.output_tokens for c in classes)
    if not weight:
        return 0
    total = sum(exact(c.rate_per_s) * c.output_tokens
                * (c.prompt_tokens + Fraction(c.output_tokens, 2)) for c in classes)
    return math.ceil(total / weight)


def served(profile: ExecutorProfile, k: Contract, classes: tuple[RequestClass, ...]) -> Served:
    """The largest step at the declared prefill share that fits one iteration (bisection
    over tokens per step; the profile's step time grows with tokens)."""
    rp, rd = exact(k.model.prefill_partition_per_s), exact(k.model.decode_partition_per_s)
    share = rp / (rp + rd)
    context, period_s = _mean_context(classes), float(k.model.iteration_ms) / 1000

    def split(n: int) -> tuple[int, int]:
        prefill = math.floor(n * share)
        return n - prefill, prefill

    def step_s(n: int) -> float:
        decodes, prefill = split(n)
        seqs = [(1, context)] * decodes + ([(prefill, 0)] if prefill else [])
        return profile.step_time(seqs)

    lo, hi = 0, MAX_TOKENS_PER_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_s(mid) <= period_s:
            lo = mid
        else:
            hi = mid - 1
    decodes, prefill = split(lo)
    return Served(decodes, prefill, context, step_s(lo) * 1000 if lo else 0.0)


def screen(profile: ExecutorProfile, k: Contract,
           classes: tuple[RequestClass, ...]) -> tuple[Contract, Served]:
    """(the contract with the served partitions, what is served). A period that not one
    step fits leaves partitions of ~0: every bound is over."""
    s = served(profile, k, classes)
    prefill, decode = s.partitions(k.model.iteration_ms)
    tiny = Fraction(1, 10**9)
    model = dataclasses.replace(k.model, prefill_partition_per_s=max(prefill, tiny),
                                decode_partition_per_s=max(decode, tiny),
                                token_budget_per_s=max(prefill + decode, 2 * tiny))
    return dataclasses.replace(k, model=model), s


def describe(profile: ExecutorProfile, declared: Contract, s: Served,
             measured: Contract) -> list[str]:
    """The key=value lines that say what the profile serves against what was declared."""
    d, m = declared.model, measured.model
    lines = [f"profile={profile.describe()}",
             f"served_per_iteration=decodes:{s.decodes},prefill_tokens:{s.prefill_tokens},"
             f"context:{s.context},step_ms:{s.step_ms:.1f}",
             f"declared_token_budget_per_s={float(d.token_budget_per_s):.0f};"
             f"served={float(m.token_budget_per_s):.0f};"
             f"prefill={float(m.prefill_partition_per_s):.0f};"
             f"decode={float(m.decode_partition_per_s):.0f}"]
    if exact(d.token_budget_per_s) > exact(m.token_budget_per_s):
        lines.append("note=the contract declares more token/s than this machine serves at "
                     "its iteration period; the audit above uses what it serves")
    return lines

"""Seed 002's capacity audit: a deterministic fluid model of one batching contract.

For a contract with token/s partitions (prefill ``Rp``, decode ``Rd``, total ``R``),
an iteration period ``T`` and request classes c (rate λ_c, prompt P_c, output O_c):

* utilization: total Σλ(P+O) ÷ R, prefill ΣλP ÷ Rp, decode ΣλO ÷ Rd;
* prefill chunk: the declared ``max_prefill_chunk_tokens`` capped by what the
  prefill partition serves in one iteration, Rp × T (a declared chunk the partition
  cannot serve is a scheduler field the audit does not trust; it says so);
* queue: a fluid M/D/1 approximation on the prefill partition (a request queues for
  its prompt's service): W = ρp × S ÷ (2 (1 − ρp)), S = mean prompt ÷ Rp;
* TTFT floor per class: W + ⌈P_c ÷ chunk⌉ × T; the worst class's is reported;
* TPOT: one token per iteration while the decode partition serves every active
  sequence, T × max(1, ⌈N ÷ (Rd × T)⌉), with N the peak active sequences;
* peak active sequences per class by Little's law, rounded up:
  N_c = ⌈λ_c × (TTFT_c + O_c × TPOT)⌉ (TPOT and N are solved as a fixed point);
* peak KV: Σ N_c × ⌈(P_c + O_c) ÷ block⌉ × block × KV bytes per token;
* fairness bound: each tier's queue under non-preemptive priority (Cobham, mean
  service) over the aggregate W; the worst ratio must stay under the contract's bound.

Every value is an exact fraction until it is printed (integers, rounded half up), so
one input always prints one answer. When the offered mix is over a bound, the audit
finds the highest rate of the lowest-priority classes (one tier at a time, from the
last) at which every bound holds: overload degrades the background class first.

What it is not: a discrete-event simulation, a latency distribution or a device
benchmark. It ignores arrival correlation, kernel shapes, allocator fragmentation,
preemption cost, prefix-cache hits and contention (hence the claim line). A passing
plan still needs trace replay (``python -m sim``) and a load test (``continuum bench``).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from continuum.batching_contract import BatchingClass, BatchingContract

CLAIM = "LOCAL_FLUID_CAPACITY_MODEL_NOT_QUEUEING_OR_DEVICE_BENCHMARK"
WITHIN, EXCEEDS = "CAPACITY_WITHIN_DECLARED_BOUND", "CAPACITY_EXCEEDS_DECLARED_BOUND"
INF = math.inf
_MS = Fraction(1000)


@dataclasses.dataclass(frozen=True)
class ClassFigures:
    name: str
    tier: int
    rate_per_s: Fraction
    ttft_floor_ms: Fraction | float
    active: int
    kv_bytes: int
    queue_ms: Fraction | float  # under priority, for the fairness bound


@dataclasses.dataclass(frozen=True)
class Report:
    utilization: Fraction
    prefill_utilization: Fraction
    decode_utilization: Fraction
    chunk_tokens: int
    chunk_capped_from: int | None  # the declared chunk, when the partition cannot serve it
    queue_ms: Fraction | float
    worst_ttft_ms: Fraction | float
    tpot_ms: Fraction | float
    active: int
    peak_kv_bytes: int
    fairness_ratio: Fraction | float
    classes: tuple[ClassFigures, ...]
    violations: tuple[str, ...]

    @property
    def decision(self) -> str:
        return EXCEEDS if self.violations else WITHIN


def half_up(x: Fraction | float) -> str:
    return "inf" if x == INF else str(math.floor(Fraction(x) + Fraction(1, 2)))


def _queue_ms(rho: Fraction, mean_service_s: Fraction) -> Fraction | float:
    return INF if rho >= 1 else rho * mean_service_s / (2 * (1 - rho)) * _MS


def _priority_queues(k: BatchingContract, classes, w0_ms) -> dict[int, Fraction | float]:
    """Cobham's non-preemptive priority waits W_t = W0 ÷ ((1 − σ_{t−1})(1 − σ_t))."""
    waits, below = {}, Fraction(0)
    for tier in sorted({c.tier for c in classes}):
        sigma = below + sum(c.rate_per_s * c.prompt_tokens for c in classes
                            if c.tier == tier) / k.prefill_partition_per_s
        waits[tier] = INF if sigma >= 1 or w0_ms == INF else w0_ms / ((1 - below) * (1 - sigma))
        below = sigma
    return waits


def evaluate(k: BatchingContract, classes: tuple[BatchingClass, ...]) -> Report:
    t_s = k.iteration_ms / _MS
    prefill = sum((c.rate_per_s * c.prompt_tokens for c in classes), Fraction(0))
    decode = sum((c.rate_per_s * c.output_tokens for c in classes), Fraction(0))
    rate = sum((c.rate_per_s for c in classes), Fraction(0))
    rho_p, rho_d = prefill / k.prefill_partition_per_s, decode / k.decode_partition_per_s
    served = math.floor(k.prefill_partition_per_s * t_s)
    chunk = min(k.max_prefill_chunk_tokens, served)
    mean_service = prefill / rate / k.prefill_partition_per_s if rate else Fraction(0)
    queue = _queue_ms(rho_p, mean_service)
    ttft = {c.name: queue + math.ceil(Fraction(c.prompt_tokens, max(chunk, 1)))
            * k.iteration_ms for c in classes}
    per_iteration = max(math.floor(k.decode_partition_per_s * t_s), 1)
    tpot, active = k.iteration_ms, {}
    for _ in range(64):  # N grows with TPOT and TPOT with N: iterate to the fixed point
        active = {c.name: _little(c, ttft[c.name], tpot) for c in classes}
        total = sum(active.values())
        new = INF if total == INF or rho_d >= 1 else (
            k.iteration_ms * max(1, math.ceil(Fraction(total, per_iteration))))
        if new == tpot:
            break
        tpot = new
    else:
        tpot = INF
    blocks = {c.name: math.ceil(Fraction(c.prompt_tokens + c.output_tokens, k.block_size))
              * k.block_size for c in classes}
    kv = {c.name: (active[c.name] * blocks[c.name] * k.kv_bytes_per_token
                   if active[c.name] != INF else INF) for c in classes}
    residual = rho_p * mean_service / 2 * _MS if rho_p < 1 else INF  # Cobham's W0
    waits = _priority_queues(k, classes, residual)
    worst_wait = max(waits.values(), default=Fraction(0))
    fairness = (INF if worst_wait == INF else Fraction(1) if queue in (0, INF)
                else worst_wait / queue)
    figures = tuple(ClassFigures(c.name, c.tier, c.rate_per_s, ttft[c.name], active[c.name],
                                 kv[c.name], waits[c.tier]) for c in classes)
    report = Report(
        utilization=(prefill + decode) / k.token_budget_per_s, prefill_utilization=rho_p,
        decode_utilization=rho_d, chunk_tokens=chunk,
        chunk_capped_from=k.max_prefill_chunk_tokens if chunk < k.max_prefill_chunk_tokens
        else None, queue_ms=queue, worst_ttft_ms=max(ttft.values(), default=Fraction(0)),
        tpot_ms=tpot, active=sum(active.values()), peak_kv_bytes=sum(kv.values()),
        fairness_ratio=fairness, classes=figures, violations=())
    return dataclasses.replace(report, violations=_violations(k, report))


def _little(c: BatchingClass, ttft_ms, tpot_ms) -> int | float:
    if ttft_ms == INF or tpot_ms == INF:
        return INF
    return math.ceil(c.rate_per_s * (ttft_ms + c.output_tokens * tpot_ms) / _MS)


def _violations(k: BatchingContract, r: Report) -> tuple[str, ...]:
    limit = Fraction(k.max_utilization_permille, 1000)
    checks = (("utilization", r.utilization > limit),
              ("prefill_utilization", r.prefill_utilization > limit),
              ("decode_utilization", r.decode_utilization > limit),
              ("queue_ms", r.queue_ms > k.slo_queue_ms),
              ("ttft_ms", r.worst_ttft_ms > k.slo_ttft_ms),
              ("tpot_ms", r.tpot_ms > k.slo_tpot_ms),
              ("active_sequences", r.active > k.max_active_sequences),
              ("peak_kv_bytes", r.peak_kv_bytes > k.kv_capacity_bytes),
              ("fairness", r.fairness_ratio > k.max_fairness_ratio))
    return tuple(name for name, over in checks if over)


def shed(k: BatchingContract, classes: tuple[BatchingClass, ...]) -> list[tuple[str, Fraction]]:
    """The admitted rate of each lowered class, lowest priority first, once the rest fit;
    [] when the offered mix is within bound."""
    if not evaluate(k, classes).violations:
        return []
    admitted, lowered = list(classes), []
    for tier in sorted({c.tier for c in classes}, reverse=True):
        idx = [i for i, c in enumerate(admitted) if c.tier == tier]
        lo, hi = Fraction(0), Fraction(1)
        for _ in range(40):  # bisect the scale of this tier's rates to 1e-12
            mid = (lo + hi) / 2
            trial = [dataclasses.replace(c, rate_per_s=c.rate_per_s * mid) if i in idx else c
                     for i, c in enumerate(admitted)]
            if evaluate(k, tuple(trial)).violations:
                hi = mid
            else:
                lo = mid
        for i in idx:
            admitted[i] = dataclasses.replace(admitted[i],
                                              rate_per_s=admitted[i].rate_per_s * lo)
            lowered.append((admitted[i].name, admitted[i].rate_per_s))
        if not evaluate(k, tuple(admitted)).violations:
            break
    return lowered


def render(k: BatchingContract, r: Report, lowered: list[tuple[str, Fraction]]) -> str:
    """The seed's key=value lines first, in its order, then the details."""
    lines = [f"example={k.example}"] if k.example else []
    lines += [f"decision={r.decision}",
              f"utilization_permille={half_up(r.utilization * 1000)};"
              f"prefill={half_up(r.prefill_utilization * 1000)};"
              f"decode={half_up(r.decode_utilization * 1000)}",
              f"queue_ms={half_up(r.queue_ms)};worst_ttft_ms={half_up(r.worst_ttft_ms)};"
              f"tpot_ms={half_up(r.tpot_ms)}",
              f"peak_kv_bytes={half_up(r.peak_kv_bytes)}",
              f"claim={CLAIM}",
              f"scope={k.scope};contract_content_id={k.content_id}",
              f"prefill_chunk_tokens={r.chunk_tokens};active_sequences={half_up(r.active)}"
              f" (bound {k.max_active_sequences});fairness_ratio_permille="
              f"{half_up(r.fairness_ratio * 1000)} (bound "
              f"{half_up(k.max_fairness_ratio * 1000)})"]
    if r.chunk_capped_from is not None:
        lines.append(f"note=max_prefill_chunk_tokens {r.chunk_capped_from} is more than the "
                     f"prefill partition serves in one {half_up(k.iteration_ms)} ms iteration; "
                     f"capped at {r.chunk_tokens}")
    if r.violations:
        lines.append(f"violations={','.join(r.violations)}")
    for c in r.classes:
        lines.append(f"class={c.name};tier={c.tier};rate_per_s={float(c.rate_per_s):g};"
                     f"ttft_floor_ms={half_up(c.ttft_floor_ms)};queue_ms={half_up(c.queue_ms)};"
                     f"active={half_up(c.active)};kv_bytes={half_up(c.kv_bytes)}")
    for name, rate in lowered:
        lines.append(f"shed class={name};admit_rate_per_s<={float(rate):.4g}")
    return "\n".join(lines)

"""The ``partitioned`` model: a deterministic fluid screen of a token/s budget split into
a prefill and a decode partition, served in iterations of a fixed period.

For partitions (prefill ``Rp``, decode ``Rd``, total ``R``), an iteration period ``T``
and request classes c (rate λ_c, prompt P_c, output O_c):

* utilization: total Σλ(P+O) ÷ R, prefill ΣλP ÷ Rp, decode ΣλO ÷ Rd;
* prefill chunk: the declared ``chunk_size`` capped by what the prefill partition serves
  in one iteration, Rp × T (a declared chunk the partition cannot serve is a scheduler
  field the audit does not trust; it says so);
* queue: a fluid M/D/1 approximation on the prefill partition (a request queues for
  its prompt's service): W = ρp × S ÷ (2 (1 − ρp)), S = mean prompt ÷ Rp;
* TTFT floor per class: W + ⌈P_c ÷ chunk⌉ × T; the worst class's is bounded;
* TPOT: one token per iteration while the decode partition serves every active
  sequence, T × max(1, ⌈N ÷ (Rd × T)⌉), with N the peak active sequences;
* peak active sequences per class by Little's law, rounded up:
  N_c = ⌈λ_c × (TTFT_c + O_c × TPOT)⌉ (TPOT and N are solved as a fixed point);
* peak KV: Σ N_c × ⌈(P_c + O_c) ÷ block⌉ × block × KV bytes per token;
* fairness bound: each tier's queue under non-preemptive priority (Cobham, mean
  service) over the aggregate W; the worst ratio must stay under the model's bound.

Every value is an exact fraction of the decimal the file holds until it is printed, so
one input always prints one answer. It ignores arrival correlation, kernel shapes,
allocator fragmentation, preemption cost, prefix-cache hits and contention.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from continuum.capacity.contract import Contract, RequestClass
from continuum.capacity.evaluation import ClassResult, Evaluation

INF = math.inf
_MS = Fraction(1000)


def exact(x) -> Fraction:
    """The decimal a file (or a float) holds, as an exact fraction."""
    return Fraction(str(x))


def _queue_ms(rho: Fraction, mean_service_s: Fraction) -> Fraction | float:
    return INF if rho >= 1 else rho * mean_service_s / (2 * (1 - rho)) * _MS


def _priority_queues(rp: Fraction, classes, w0_ms) -> dict[int, Fraction | float]:
    """Cobham's non-preemptive priority waits W_t = W0 ÷ ((1 − σ_{t−1})(1 − σ_t))."""
    waits, below = {}, Fraction(0)
    for tier in sorted({c.tier for c in classes}):
        sigma = below + sum(exact(c.rate_per_s) * c.prompt_tokens for c in classes
                            if c.tier == tier) / rp
        waits[tier] = INF if sigma >= 1 or w0_ms == INF else w0_ms / ((1 - below) * (1 - sigma))
        below = sigma
    return waits


def evaluate(k: Contract, classes: tuple[RequestClass, ...]) -> Evaluation:
    m = k.model
    rp, rd, iteration_ms = (exact(m.prefill_partition_per_s), exact(m.decode_partition_per_s),
                            exact(m.iteration_ms))
    t_s = iteration_ms / _MS
    lam = {c.name: exact(c.rate_per_s) for c in classes}
    prefill = sum((lam[c.name] * c.prompt_tokens for c in classes), Fraction(0))
    decode = sum((lam[c.name] * c.output_tokens for c in classes), Fraction(0))
    rate = sum(lam.values(), Fraction(0))
    rho_p, rho_d = prefill / rp, decode / rd
    chunk = min(k.chunk_size, math.floor(rp * t_s))
    mean_service = prefill / rate / rp if rate else Fraction(0)
    queue = _queue_ms(rho_p, mean_service)
    ttft = {c.name: queue + math.ceil(Fraction(c.prompt_tokens, max(chunk, 1))) * iteration_ms
            for c in classes}
    per_iteration = max(math.floor(rd * t_s), 1)
    tpot, active = iteration_ms, {}
    for _ in range(64):  # N grows with TPOT and TPOT with N: iterate to the fixed point
        active = {c.name: _little(lam[c.name], c, ttft[c.name], tpot) for c in classes}
        total = sum(active.values())
        new = INF if total == INF or rho_d >= 1 else (
            iteration_ms * max(1, math.ceil(Fraction(total, per_iteration))))
        if new == tpot:
            break
        tpot = new
    else:
        tpot = INF
    block = m.block_size
    kv = {c.name: (active[c.name] * math.ceil(Fraction(c.prompt_tokens + c.output_tokens,
                                                       block)) * block * k.kv_bytes_per_token
                   if active[c.name] != INF else INF) for c in classes}
    residual = rho_p * mean_service / 2 * _MS if rho_p < 1 else INF  # Cobham's W0
    waits = _priority_queues(rp, classes, residual)
    worst_wait = max(waits.values(), default=Fraction(0))
    fairness = (INF if worst_wait == INF else Fraction(1) if queue in (0, INF)
                else worst_wait / queue)
    results = tuple(ClassResult(c.name, c.tier, lam[c.name], waits[c.tier], ttft[c.name],
                                active[c.name], kv[c.name]) for c in classes)
    details = [f"fairness_ratio_permille={_half_up(fairness * 1000)} "
               f"(bound {_half_up(exact(m.max_fairness_ratio) * 1000)})"]
    if chunk < k.chunk_size:
        details.append(f"note=chunk_size {k.chunk_size} is more than the prefill partition "
                       f"serves in one {_half_up(iteration_ms)} ms iteration; capped at {chunk}")
    ev = Evaluation(
        utilization=(prefill + decode) / exact(m.token_budget_per_s), prefill_utilization=rho_p,
        decode_utilization=rho_d, chunk_tokens=chunk, queue_ms=queue,
        worst_ttft_ms=max(ttft.values(), default=Fraction(0)), tpot_ms=tpot,
        worst_iteration_ms=iteration_ms, active=sum(active.values()),
        peak_kv_bytes=sum(kv.values()), classes=results, violations=(),
        details=tuple(details))
    return _with_violations(k, ev, fairness)


def _half_up(x) -> str:
    return "inf" if x == INF else str(math.floor(Fraction(x) + Fraction(1, 2)))


def _little(lam: Fraction, c: RequestClass, ttft_ms, tpot_ms) -> int | float:
    if ttft_ms == INF or tpot_ms == INF:
        return INF
    return math.ceil(lam * (ttft_ms + c.output_tokens * tpot_ms) / _MS)


def _with_violations(k: Contract, r: Evaluation, fairness) -> Evaluation:
    limit = exact(k.max_utilization)
    checks = (("utilization", r.utilization > limit),
              ("prefill_utilization", r.prefill_utilization > limit),
              ("decode_utilization", r.decode_utilization > limit),
              ("queue_ms", r.queue_ms > exact(k.slo_queue_ms)),
              ("ttft_ms", r.worst_ttft_ms > exact(k.slo_ttft_ms)),
              ("tpot_ms", r.tpot_ms > exact(k.slo_tpot_ms)),
              ("active_sequences", r.active > k.max_num_seqs),
              ("kv_memory", r.peak_kv_bytes > k.kv_memory_bytes),
              ("fairness", fairness > exact(k.model.max_fairness_ratio)))
    return dataclasses.replace(r, violations=tuple(name for name, over in checks if over))

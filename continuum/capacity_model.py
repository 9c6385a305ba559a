"""The fluid screening model behind ``continuum capacity audit`` (see capacity.py).

Pure arithmetic on declared numbers: no queue is simulated, nothing is measured.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

from continuum.contract import Contract, RequestClass

INF = math.inf


@dataclasses.dataclass
class ClassResult:
    name: str
    priority: int
    rate_per_s: float
    utilization: float
    queue_ms: float
    ttft_floor_ms: float
    concurrency: float
    peak_kv_bytes: float
    violations: list[str]


@dataclasses.dataclass
class Evaluation:
    utilization: float
    prefill_utilization: float
    decode_utilization: float
    concurrency: float
    iteration_ms: float  # the fluid TPOT floor
    worst_iteration_ms: float  # a decode iteration that also carries a full prefill budget
    peak_kv_bytes: float
    classes: list[ClassResult]
    violations: list[str]  # contract-wide bounds: "utilization", "active_slots", ...

    @property
    def ok(self) -> bool:
        return not self.violations and not any(c.violations for c in self.classes)

    def violated(self) -> list[str]:
        out = list(self.violations)
        for c in self.classes:
            out += [f"{v} ({c.name})" for v in c.violations]
        return out


def decode_step_s(contract: Contract, batch: float, context: float) -> float:
    """Declared step time at ``batch`` (linear between points, extended by the last
    segment's slope), plus reading ``batch × context`` tokens of KV."""
    pts = contract.decode_step_ms
    xs = [b for b, _ in pts]
    if len(pts) == 1 or batch <= xs[0]:
        ms = pts[0][1]
    else:
        i = min(bisect.bisect_right(xs, batch), len(pts) - 1)
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        ms = t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    kv = batch * context * contract.kv_bytes_per_token / contract.kv_read_bytes_per_s
    return ms / 1e3 + kv


def _effective_output(c: RequestClass) -> float:
    """A cancelled request stops on average half way through its output."""
    return c.output_tokens_mean * (1 - c.cancel_fraction / 2)


def evaluate(contract: Contract, classes: Sequence[RequestClass]) -> Evaluation:
    k = contract
    b_max = k.max_num_seqs
    r_p = k.prefill_tokens_per_s
    # Mean context of a decoding sequence, weighted by decode work.
    work = [(c.rate_per_s * _effective_output(c), c.prompt_tokens_mean
             + _effective_output(c) / 2) for c in classes]
    total_work = sum(w for w, _ in work)
    context = sum(w * ctx for w, ctx in work) / total_work if total_work else 0.0
    per_token_full = decode_step_s(k, b_max, context) / b_max
    service = {c.name: c.prompt_tokens_mean / r_p + _effective_output(c) * per_token_full
               for c in classes}
    rho = {c.name: c.rate_per_s * service[c.name] for c in classes}
    rho_p = sum(c.rate_per_s * c.prompt_tokens_mean for c in classes) / r_p
    rho_d = sum(c.rate_per_s * _effective_output(c) for c in classes) * per_token_full
    total = rho_p + rho_d
    violations = []
    if total > k.max_utilization:
        violations.append("utilization")

    prefill_per_iter = max(1, min(k.chunk_size, k.max_num_batched_tokens - b_max))
    worst_iter = decode_step_s(k, b_max, context) + (k.max_num_batched_tokens - b_max) / r_p
    n, t_iter = _iteration(k, classes, context, rho_p, prefill_per_iter, worst_iter)
    if n > b_max:
        violations.append("active_slots")
    tokens_per_iter = sum(c.rate_per_s * c.prompt_tokens_mean for c in classes) * t_iter
    if tokens_per_iter + min(n, b_max) > k.max_num_batched_tokens:
        violations.append("token_budget")
    if worst_iter * 1e3 > k.slo_tpot_ms and any(not c.best_effort for c in classes):
        violations.append("tpot")

    results = _per_class(k, classes, service, rho, prefill_per_iter, t_iter)
    peak_kv = sum(c.peak_kv_bytes for c in results)
    if peak_kv > k.kv_memory_bytes:
        violations.append("kv_memory")
    return Evaluation(total, rho_p, rho_d, n, t_iter * 1e3, worst_iter * 1e3, peak_kv,
                      results, violations)


def _iteration(k: Contract, classes: Sequence[RequestClass], context: float, rho_p: float,
               prefill_per_iter: int, worst_iter: float) -> tuple[float, float]:
    """(concurrency N, iteration seconds T) at the fixed point N = Σ λ (prefill
    iterations + output) × T(N), T(N) = t(N) ÷ (1 − ρ_prefill) capped at the worst
    iteration; N is infinite when prefill alone saturates the device."""
    n, t_iter = 1.0, decode_step_s(k, 1, context)
    if rho_p >= 1:
        return INF, worst_iter
    for _ in range(200):
        t_iter = min(decode_step_s(k, n, context) / (1 - rho_p), worst_iter)
        n_next = sum(c.rate_per_s * (math.ceil(c.prompt_tokens_mean / prefill_per_iter)
                                     + _effective_output(c)) for c in classes) * t_iter
        if n_next > 4 * k.max_num_seqs:
            return n_next, t_iter
        if abs(n_next - n) < 1e-6:
            break
        n = max(n_next, 1.0)
    return n, t_iter


def _per_class(k: Contract, classes: Sequence[RequestClass], service: dict[str, float],
               rho: dict[str, float], prefill_per_iter: int, t_iter: float
               ) -> list[ClassResult]:
    """Queue delay, TTFT floor, concurrency and KV of each class, most important first."""
    # Queue delay per priority tier: non-preemptive priority M/G/1 (Cobham's formula),
    # service spread of an exponential (E[S²] = 2 E[S]²).
    w0 = sum(c.rate_per_s * 2 * service[c.name] ** 2 for c in classes) / 2
    tiers = sorted({c.priority for c in classes})
    sigma = {t: sum(rho[c.name] for c in classes if c.priority <= t) for t in tiers}
    results = []
    for c in sorted(classes, key=lambda c: c.priority):
        i = tiers.index(c.priority)
        above = sigma[tiers[i - 1]] if i else 0.0
        mine = sigma[c.priority]
        wait = w0 / ((1 - above) * (1 - mine)) if mine < 1 else INF
        iters = math.ceil(c.prompt_tokens_p99 / prefill_per_iter)
        ttft = wait + iters * t_iter
        conc = c.rate_per_s * (math.ceil(c.prompt_tokens_mean / prefill_per_iter)
                               + _effective_output(c)) * t_iter
        kv = conc * (c.prompt_tokens_p99 + c.output_tokens_p99) * k.kv_bytes_per_token
        kv += (c.rate_per_s * c.cancel_fraction * c.cancel_lag_ms / 1e3
               * (c.prompt_tokens_mean + c.output_tokens_mean / 2) * k.kv_bytes_per_token)
        bad = []
        if not c.best_effort:
            if wait * 1e3 > k.slo_queue_delay_ms:
                bad.append("queue_delay")
            if ttft * 1e3 > k.slo_ttft_ms:
                bad.append("ttft")
        results.append(ClassResult(c.name, c.priority, c.rate_per_s, rho[c.name], wait * 1e3,
                                   ttft * 1e3, conc, kv, bad))
    return results


@dataclasses.dataclass
class Decision:
    verdict: str  # CAPACITY_WITHIN_DECLARED_BOUND | SHED_LOWEST_PRIORITY | OVER_DECLARED_BOUND
    offered: Evaluation
    admitted: Evaluation | None = None  # after shedding
    shed: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)
    # (class, admissible rate, offered rate)
    kept: list[str] = dataclasses.field(default_factory=list)


def decide(contract: Contract, classes: Sequence[RequestClass]) -> Decision:
    """Within bound; else shed from the lowest priority up; else over bound."""
    offered = evaluate(contract, classes)
    if offered.ok:
        return Decision("CAPACITY_WITHIN_DECLARED_BOUND", offered)
    order = sorted(classes, key=lambda c: c.priority)
    # The longest run of most important classes that fits in full.
    kept = 0
    while kept < len(order) and evaluate(contract, order[:kept + 1]).ok:
        kept += 1
    if kept == 0:
        return Decision("OVER_DECLARED_BOUND", offered)
    # Fill the next class up to the rate at which every bound still holds.
    nxt = order[kept]
    lo, hi = 0.0, nxt.rate_per_s
    for _ in range(40):
        mid = (lo + hi) / 2
        trial = [*order[:kept], dataclasses.replace(nxt, rate_per_s=mid)]
        lo, hi = (mid, hi) if evaluate(contract, trial).ok else (lo, mid)
    admitted = [*order[:kept], dataclasses.replace(nxt, rate_per_s=lo)]
    shed = [(nxt.name, lo, nxt.rate_per_s)] + [(c.name, 0.0, c.rate_per_s)
                                                for c in order[kept + 1:]]
    return Decision("SHED_LOWEST_PRIORITY", offered, evaluate(contract, admitted), shed,
                    [c.name for c in order[:kept]])

"""The ``service-curve`` model: a fluid screen of a declared prefill rate and decode step
curve (docs/capacity/README.md). Pure arithmetic on declared numbers: no queue is
simulated, nothing is measured.

* device time per request of class c: s_c = P_c ÷ R_prefill + O_c × t(B) ÷ B, with
  t(n) the declared decode step time at batch n (plus its KV reads) and B =
  max_num_seqs: decodes in full batches, the cheapest they can be;
* utilization ρ = Σ λ_c s_c, split into prefill and decode shares;
* iteration time T = t(N) ÷ (1 − ρ_prefill) (each iteration carries its share of
  prefill), capped by a full token budget; concurrency N = Σ λ_c × (time in
  service) by Little's law, solved as a fixed point;
* queue delay per tier: non-preemptive priority M/G/1 (Cobham), exponential
  service-time spread: W_k = W₀ ÷ ((1 − σ_{k−1})(1 − σ_k)), σ_k the load of tiers ≤ k;
* TTFT floor = W + ⌈P99 ÷ prefill tokens per iteration⌉ × T; TPOT floor = T; worst
  iteration = t(N) + a full budget of prefill;
* peak KV = Σ N_c × (P99_c + O99_c) × KV bytes/token + what cancelled requests hold
  for their cancellation lag.

It ignores burstiness, correlation, fragmentation and preemption.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from continuum.capacity.contract import Contract, RequestClass
from continuum.capacity.evaluation import ClassResult, Evaluation

INF = math.inf


def decode_step_s(contract: Contract, batch: float, context: float) -> float:
    """Declared step time at ``batch`` (linear between points, extended by the last
    segment's slope), plus reading ``batch × context`` tokens of KV."""
    pts = contract.model.decode_step_ms
    xs = [b for b, _ in pts]
    if len(pts) == 1 or batch <= xs[0]:
        ms = pts[0][1]
    else:
        i = min(bisect.bisect_right(xs, batch), len(pts) - 1)
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        ms = t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    kv = batch * context * contract.kv_bytes_per_token / contract.model.kv_read_bytes_per_s
    return ms / 1e3 + kv


def _effective_output(c: RequestClass) -> float:
    """A cancelled request stops on average half way through its output."""
    return c.output_tokens * (1 - c.cancel_fraction / 2)


def evaluate(contract: Contract, classes: Sequence[RequestClass]) -> Evaluation:
    k = contract
    b_max = k.max_num_seqs
    r_p = k.model.prefill_tokens_per_s
    # Mean context of a decoding sequence, weighted by decode work.
    work = [(c.rate_per_s * _effective_output(c), c.prompt_tokens
             + _effective_output(c) / 2) for c in classes]
    total_work = sum(w for w, _ in work)
    context = sum(w * ctx for w, ctx in work) / total_work if total_work else 0.0
    per_token_full = decode_step_s(k, b_max, context) / b_max
    service = {c.name: c.prompt_tokens / r_p + _effective_output(c) * per_token_full
               for c in classes}
    rho = {c.name: c.rate_per_s * service[c.name] for c in classes}
    rho_p = sum(c.rate_per_s * c.prompt_tokens for c in classes) / r_p
    rho_d = sum(c.rate_per_s * _effective_output(c) for c in classes) * per_token_full
    total = rho_p + rho_d
    violations = []
    if total > k.max_utilization:
        violations.append("utilization")

    prefill_per_iter = max(1, min(k.chunk_size, k.max_num_batched_tokens - b_max))
    worst_iter = decode_step_s(k, b_max, context) + (k.max_num_batched_tokens - b_max) / r_p
    n, t_iter = _iteration(k, classes, context, rho_p, prefill_per_iter, worst_iter)
    if n > b_max:
        violations.append("active_sequences")
    tokens_per_iter = sum(c.rate_per_s * c.prompt_tokens for c in classes) * t_iter
    if tokens_per_iter + min(n, b_max) > k.max_num_batched_tokens:
        violations.append("token_budget")
    if worst_iter * 1e3 > k.slo_tpot_ms and any(not c.best_effort for c in classes):
        violations.append("tpot_ms")

    results = _per_class(k, classes, service, rho, prefill_per_iter, t_iter)
    peak_kv = sum(c.kv_bytes for c in results)
    if peak_kv > k.kv_memory_bytes:
        violations.append("kv_memory")
    return Evaluation(total, rho_p, rho_d, prefill_per_iter,
                      max((c.queue_ms for c in results), default=0.0),
                      max((c.ttft_floor_ms for c in results), default=0.0),
                      t_iter * 1e3, worst_iter * 1e3, n, peak_kv, tuple(results),
                      tuple(violations))


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
        n_next = sum(c.rate_per_s * (math.ceil(c.prompt_tokens / prefill_per_iter)
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
    tiers = sorted({c.tier for c in classes})
    sigma = {t: sum(rho[c.name] for c in classes if c.tier <= t) for t in tiers}
    results = []
    for c in sorted(classes, key=lambda c: c.tier):
        i = tiers.index(c.tier)
        above = sigma[tiers[i - 1]] if i else 0.0
        mine = sigma[c.tier]
        wait = w0 / ((1 - above) * (1 - mine)) if mine < 1 else INF
        iters = math.ceil(c.prompt_tokens_p99 / prefill_per_iter)
        ttft = wait + iters * t_iter
        conc = c.rate_per_s * (math.ceil(c.prompt_tokens / prefill_per_iter)
                               + _effective_output(c)) * t_iter
        kv = conc * (c.prompt_tokens_p99 + c.output_tokens_p99) * k.kv_bytes_per_token
        kv += (c.rate_per_s * c.cancel_fraction * c.cancel_lag_ms / 1e3
               * (c.prompt_tokens + c.output_tokens / 2) * k.kv_bytes_per_token)
        bad = []
        if not c.best_effort:
            if wait * 1e3 > k.slo_queue_ms:
                bad.append("queue_ms")
            if ttft * 1e3 > k.slo_ttft_ms:
                bad.append("ttft_ms")
        results.append(ClassResult(c.name, c.tier, c.rate_per_s, wait * 1e3, ttft * 1e3,
                                   conc, kv, tuple(bad)))
    return results

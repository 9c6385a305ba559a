"""Serving metrics with the definitions of ``vllm bench serve``, dependency-free.

Shared by the simulator and the live load generator, so a simulated table and a
measured one mean the same thing. Per request, in seconds from any common origin:

* TTFT = first token − arrival.
* TPOT = (E2E − TTFT) ÷ (output tokens − 1): the mean gap after the first token,
  counted only for requests with more than one output token.
* ITL = every gap between consecutive tokens (or streamed chunks) of a request
  (``itl_gaps``), pooled over all requests; needs the token times.
* E2E = finish − arrival.

Percentiles interpolate linearly between closest ranks (numpy's default), so
``percentile([1, 2, 3, 4], 50) == 2.5``. Throughputs divide by the run's duration:
the one given, else first arrival to last finish.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# (arrival_s, first_token_s, finish_s, num_output_tokens[, token_times])
Timing = Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 ≤ p ≤ 100), linear between closest ranks; NaN if empty."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def tpot(ttft_s: float, e2e_s: float, num_output_tokens: int) -> float | None:
    """Time per output token after the first: (E2E − TTFT) ÷ (output tokens − 1).

    The one definition every table uses (simulator, ``continuum bench``, the
    benchmarks). None for a request with fewer than two output tokens: it has no
    gap after its first token, so it has no TPOT (and is left out of TPOT
    statistics rather than counted as zero).
    """
    if num_output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (num_output_tokens - 1)


def itl_gaps(token_times: Sequence[float]) -> list[float]:
    """One request's inter-token latencies: every gap between consecutive token (or
    streamed chunk) times. The one definition every table pools (simulator,
    ``continuum bench``, the reliability rows)."""
    return [b - a for a, b in zip(token_times, token_times[1:], strict=False)]


def _stats(name: str, values_s: Sequence[float], percentiles: Iterable[float],
           into: dict[str, float]) -> None:
    """mean / median / pNN of ``values_s``, reported in milliseconds."""
    values_ms = [v * 1e3 for v in values_s]
    mean = sum(values_ms) / len(values_ms) if values_ms else float("nan")
    into[f"{name}_mean_ms"] = mean
    into[f"{name}_median_ms"] = percentile(values_ms, 50)
    for p in percentiles:
        into[f"{name}_p{p:g}_ms"] = percentile(values_ms, p)


def summarize(requests: Iterable[Timing], duration_s: float | None = None,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              slo_e2e_ms: float | None = None,
              percentiles: Sequence[float] = (90, 99)) -> dict[str, float]:
    """Summary of completed requests: latency statistics, throughputs, goodput.

    Goodput counts requests that meet every SLO given (a request with one output
    token has no TPOT and meets any TPOT SLO), per second of ``duration_s``;
    ``goodput_fraction`` is their share of completed requests.
    """
    ttfts, tpots, e2es, gaps = [], [], [], []
    num_good = num_output = 0
    first_arrival, last_finish = float("inf"), float("-inf")
    completed = 0
    for req in requests:
        arrival, first, finish, n_out = req[0], req[1], req[2], int(req[3])
        completed += 1
        num_output += n_out
        first_arrival = min(first_arrival, arrival)
        last_finish = max(last_finish, finish)
        ttft, e2e = first - arrival, finish - arrival
        ttfts.append(ttft)
        e2es.append(e2e)
        per_token = tpot(ttft, e2e, n_out)
        if per_token is not None:
            tpots.append(per_token)
        if len(req) > 4 and req[4]:
            gaps.extend(itl_gaps(req[4]))
        good = ((slo_ttft_ms is None or ttft * 1e3 <= slo_ttft_ms)
                and (slo_tpot_ms is None or per_token is None
                     or per_token * 1e3 <= slo_tpot_ms)
                and (slo_e2e_ms is None or e2e * 1e3 <= slo_e2e_ms))
        num_good += good
    if duration_s is None:
        duration_s = last_finish - first_arrival if completed else 0.0
    per_s = (1.0 / duration_s) if duration_s > 0 else float("nan")
    out: dict[str, float] = {
        "completed": float(completed),
        "total_output_tokens": float(num_output),
        "duration_s": float(duration_s),
        "request_throughput": completed * per_s,
        "output_throughput": num_output * per_s,
        "goodput": num_good * per_s,
        "goodput_fraction": num_good / completed if completed else float("nan"),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", gaps), ("e2e", e2es)):
        _stats(name, values, percentiles, out)
    return out


def cost_per_million(output_tokens_per_s: float, dollars_per_hour: float) -> float:
    """Dollars per 1M output tokens at ``output_tokens_per_s`` on hardware rented at
    ``dollars_per_hour`` (default: $8.20/h spot 4xA100, target under $0.50);
    NaN when nothing was produced."""
    if not output_tokens_per_s > 0:
        return float("nan")
    return dollars_per_hour / 3600.0 / output_tokens_per_s * 1e6

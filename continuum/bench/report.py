"""``continuum bench``'s report: summaries overall, per tier and per tenant; the sweep plot.

Every latency statistic comes from ``sim.metrics.summarize`` (TTFT, TPOT, ITL, E2E,
goodput with ``vllm bench serve``'s definitions), the same code that summarizes a
simulated run, so a measured table and a simulated one mean the same thing.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from protos import tiers
from sim.metrics import cost_per_million, summarize

if TYPE_CHECKING:  # the clients load grpc and aiohttp, which a report does not need
    from continuum.bench.clients import Outcome


def summarize_outcomes(outcomes: Sequence[Outcome], duration_s: float,
                       slos: dict[str, float], dollars_per_hour: float | None = None) -> dict:
    """Overall, per tier and per tenant summaries (sim.metrics definitions; SLOs in ms);
    with ``dollars_per_hour`` the overall one also has ``cost_per_1m_output_tokens``."""
    report = _summaries(outcomes, duration_s, slos)
    if dollars_per_hour is not None:
        report["dollars_per_hour"] = dollars_per_hour
        report["overall"]["cost_per_1m_output_tokens"] = cost_per_million(
            report["overall"]["output_throughput"], dollars_per_hour)
    return report


def _summaries(outcomes: Sequence[Outcome], duration_s: float, slos: dict[str, float]) -> dict:
    def group(items: Sequence[Outcome]) -> dict:
        timings = [(o.sent_s, o.first_token_s, o.finish_s, o.output_tokens, o.chunk_times)
                   for o in items if o.completed and o.first_token_s is not None]
        result = summarize(timings, duration_s, slo_ttft_ms=slos.get("ttft"),
                           slo_tpot_ms=slos.get("tpot"), slo_e2e_ms=slos.get("e2e"))
        result["num_requests"] = len(items)
        result["num_completed"] = len(timings)
        result["num_cancelled"] = sum(o.status == "cancelled" for o in items)
        errors: dict[str, int] = {}
        for o in items:
            if o.status not in ("ok", "cancelled"):
                errors[o.code or o.status] = errors.get(o.code or o.status, 0) + 1
        result["errors"] = errors
        return result

    report = {"duration_s": duration_s, "overall": group(outcomes), "by_tier": {},
              "by_tenant": {}}
    for tier in sorted({o.tier for o in outcomes}):
        report["by_tier"][tiers.name(tier)] = group([o for o in outcomes if o.tier == tier])
    for tenant in sorted({o.tenant for o in outcomes}):
        report["by_tenant"][tenant] = group([o for o in outcomes if o.tenant == tenant])
    return report


def _ms(value) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.0f}"


def format_report(report: dict, title: str) -> str:
    lines = [title]
    header = (f"{'group':<16}{'done':>6}{'cancel':>7}{'err':>5}{'req/s':>7}{'out tok/s':>10}"
              f"{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}{'p99':>7}{'ITL p99':>8}"
              f"{'E2E p50':>8}{'goodput':>8}")
    lines.append(header + "   (latencies in ms)")

    def row(name: str, s: dict) -> str:
        get = s.get
        return (f"{name:<16}{s['num_completed']:>6}{s['num_cancelled']:>7}"
                f"{sum(s['errors'].values()):>5}{get('request_throughput', 0):>7.2f}"
                f"{get('output_throughput', 0):>10.1f}{_ms(get('ttft_median_ms')):>9}"
                f"{_ms(get('ttft_p99_ms')):>7}{_ms(get('tpot_median_ms')):>9}"
                f"{_ms(get('tpot_p99_ms')):>7}{_ms(get('itl_p99_ms')):>8}"
                f"{_ms(get('e2e_median_ms')):>8}"
                f"{get('goodput', 0):>8.2f}")

    lines.append(row("overall", report["overall"]))
    for name, s in report["by_tier"].items():
        lines.append(row(f"tier {name}", s))
    for name, s in report["by_tenant"].items():
        lines.append(row(f"tenant {name}", s))
    cost = report["overall"].get("cost_per_1m_output_tokens")
    if cost is not None:
        lines.append(f"cost: ${cost:.3f} per 1M output tokens at "
                     f"${report['dollars_per_hour']:g}/h")
    errors = report["overall"]["errors"]
    if errors:
        lines.append("errors: " + ", ".join(f"{k} × {v}" for k, v in sorted(errors.items())))
    return "\n".join(lines)


def plot_sweep(points: list[tuple[float, dict]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r, _ in points]
    fig, (ttft, tpot, tput) = plt.subplots(1, 3, figsize=(15, 4.5))
    for key, style in (("median", "-o"), ("p90", "--s"), ("p99", ":^")):
        for axis, name in ((ttft, "ttft"), (tpot, "tpot")):
            axis.plot(rates, [p["overall"].get(f"{name}_{key}_ms", math.nan) for _, p in points],
                      style, label=key)
    tput.plot(rates, [p["overall"].get("output_throughput", 0) for _, p in points], "-o")
    ttft.set(title="TTFT vs offered load", xlabel="request rate (req/s)", ylabel="ms")
    tpot.set(title="TPOT vs offered load", xlabel="request rate (req/s)", ylabel="ms")
    tput.set(title="output tokens/s", xlabel="request rate (req/s)", ylabel="tokens/s")
    ttft.legend()
    tpot.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

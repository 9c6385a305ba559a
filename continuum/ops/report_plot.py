"""``continuum report --plot``: the report's figures over time, one line per tenant.

Four panels sharing a time axis: p99 queue wait, p99 TTFT and p50 TPOT per
tenant (or per tier where there are more than ``MAX_LINES`` tenants), and the
scheduler's step latency (mean and max per minute) with preemptions, so a spike
in one tenant's TTFT lines up with what the steps were doing at that moment.
"""

from __future__ import annotations

import datetime as dt
import math
import pathlib

from protos import tiers
from sim.metrics import percentile
from telemetry import TelemetryStore

MAX_LINES = 8
# Bin widths tried in order; the first giving at most MAX_BINS bins is used.
_BIN_WIDTHS_S = (10, 30, 60, 300, 900, 3600, 4 * 3600, 86400)
MAX_BINS = 60


def _bin_width(since: float, until: float) -> float:
    span = until - since
    return next((w for w in _BIN_WIDTHS_S if span / w <= MAX_BINS), _BIN_WIDTHS_S[-1])


def plot(store: TelemetryStore, since: float, until: float, tenant: str | None,
         tier: int | None, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in store.sequences(since, until, tenant=tenant, tier=tier)
               if r.status == "finished"]
    tenants = sorted({r.tenant for r in records})
    by_tier = len(tenants) > MAX_LINES
    key = (lambda r: tiers.name(r.tier)) if by_tier else (lambda r: r.tenant)
    width = _bin_width(since, until)
    nbins = max(1, math.ceil((until - since) / width))
    edges = [dt.datetime.fromtimestamp(since + (i + 0.5) * width) for i in range(nbins)]
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    panels = (("queue wait p99 (ms)", lambda r: r.queue_wait_ms, 99),
              ("TTFT p99 (ms)", lambda r: r.ttft_ms, 99),
              ("TPOT p50 (ms)", lambda r: r.tpot_p50_ms, 50))
    for axis, (title, get, pct) in zip(axes, panels, strict=False):
        for name in sorted({key(r) for r in records}):
            bins: list[list[float]] = [[] for _ in range(nbins)]
            for r in records:
                if key(r) == name and get(r) is not None:
                    bins[min(int((r.completed_at - since) // width), nbins - 1)].append(get(r))
            axis.plot(edges, [percentile(b, pct) for b in bins], "-o", ms=3, label=name)
        axis.set(title=title)
        if records:
            axis.legend(loc="upper left", fontsize="small")
    steps = axes[3]
    minutes = store.iteration_minutes(since, until)
    times = [dt.datetime.fromtimestamp(m.minute + 30) for m in minutes]
    steps.plot(times, [m.sum_step_latency_ms / m.num_steps for m in minutes], "-", label="mean")
    steps.plot(times, [m.max_step_latency_ms for m in minutes], ":", label="max")
    steps.set(title="step latency per minute (ms); bars: preemptions", xlabel="local time")
    steps.legend(loc="upper left", fontsize="small")
    twin = steps.twinx()
    twin.bar(times, [m.sum_preemptions for m in minutes], width=40 / 86400, alpha=0.3,
             color="red")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

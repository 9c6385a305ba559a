"""What the metrics cost the loops they run on: an observe, and rendering each page.

The gateway observes every token gap of every stream on its event loop and renders its
page per scrape; the replica renders its whole page on the scheduling loop every 50 ms
(scheduler_svc/metrics.py). This times both with runtime/metrics.py and, for the
comparison docs/facts.md "Metrics exposition" records, with prometheus_client holding
the same families and children.

    .venv/bin/python -m benchmarks.bench_metrics_render
"""

from __future__ import annotations

import timeit
import types

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from gateway.metrics import GatewayMetrics
from protos import tiers
from protos.continuum.v1 import scheduler_pb2
from runtime import metric_names as names
from runtime.metrics import COUNTER, GAUGE, HISTOGRAM, Metric
from scheduler_svc import metrics as replica_metrics
from tests.scheduler.factories import make_request
from tests.scheduler.test_replica_metrics import _loop

GAPS = [0.003 * (i % 1000) for i in range(1000)]  # seconds, across the ITL buckets


def best_s(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number


def _prometheus_twin(held: list[Metric]) -> CollectorRegistry:
    """prometheus_client holding what ``held`` holds, family for family."""
    registry = CollectorRegistry()
    for metric in held:
        f = metric.family
        twin = ({COUNTER: Counter, GAUGE: Gauge}[f.kind](f.name, f.help, f.labels,
                                                         registry=registry)
                if f.kind != HISTOGRAM else Histogram(f.name, f.help, f.labels,
                                                      buckets=f.buckets, registry=registry))
        for values, value in metric.children.items():
            child = twin.labels(*values)
            if f.kind == HISTOGRAM:
                for gap in GAPS[:value.count]:
                    child.observe(gap)
            elif f.kind == COUNTER:
                child.inc(value)
            else:
                child.set(value)
    return registry


def _replica_page() -> tuple[object, replica_metrics.Histograms]:
    """A loop with 64 requests queued and 500 ended, as render reads it."""
    loop = _loop(None)
    for i in range(64):
        loop.core.add_request(make_request(8, 4, request_id=f"w{i}", priority_tier=i % 3))
    hist = replica_metrics.Histograms()
    for i in range(500):
        req = make_request(8, 4, request_id=f"d{i}")
        req.arrival_time, req.first_scheduled_time = 10.0, 10.2
        hist.request_ended(req, [11.0 + 0.03 * k for k in range(20)], 1)
    return loop, hist


def _gateway() -> GatewayMetrics:
    """A gateway with 4 replicas and 100 requests ended in each tier."""
    stats = scheduler_pb2.StatsResponse(num_total_blocks=800, num_free_blocks=400,
                                        num_running_by_tier=[3, 9, 2],
                                        num_waiting_by_tier=[1, 2, 3])
    replica = types.SimpleNamespace(healthy=True, stats=stats)
    gateway = GatewayMetrics("m", lambda: [(f"10.0.0.{i}:50061", replica) for i in range(4)],
                             4096)
    for tier in range(tiers.NUM_TIERS):
        labels = gateway.labels(tier)
        for metric in (gateway.ttft, gateway.itl, gateway.e2e, gateway.queue):
            for gap in GAPS[:100]:
                metric.child(labels).observe(gap)
        gateway.success.inc((*labels, "stop"))
    gateway.error("INVALID_ARGUMENT")
    return gateway


def main() -> None:
    disable_created_metrics()  # as the gateway had it: no `*_created` series
    ours = Metric(names.GATEWAY_ITL).child(("m", "standard"))
    theirs = Histogram("x", "x", ["model_name", "priority"], buckets=names.ITL_BUCKETS,
                       registry=CollectorRegistry()).labels("m", "standard")
    for name, hist in (("runtime.metrics", ours), ("prometheus_client", theirs)):
        ns = best_s(lambda h=hist: [h.observe(g) for g in GAPS], 200) / len(GAPS) * 1e9
        print(f"observe, {name:22s} {ns:8.0f} ns")
    loop, hist = _replica_page()
    size = len(replica_metrics.render(loop, hist, "m"))
    us = best_s(lambda: replica_metrics.render(loop, hist, "m"), 2000) * 1e6
    print(f"replica page ({size:,} bytes), runtime.metrics {us:.1f} us")
    gateway = _gateway()
    us = best_s(gateway.render, 500) * 1e6
    print(f"gateway page ({len(gateway.render()):,} bytes), runtime.metrics {us:.1f} us")
    held = [m for m in vars(gateway).values() if isinstance(m, Metric)]
    twin = _prometheus_twin(held)
    for name, fn in (("runtime.metrics", lambda: "".join(m.lines() for m in held).encode()),
                     ("prometheus_client", lambda: generate_latest(twin))):
        print(f"  its own families, {name:22s} {best_s(fn, 500) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()

"""Prometheus metrics served at the gateway's `/metrics`.

Request metrics (latencies, tokens, outcomes) are measured here, where the
client's experience is. Engine gauges (running, waiting, KV usage,
preemptions) come from each scheduler replica's latest `Stats`, labelled by
replica address: several gateways in front of the same replicas report the
same values, so aggregate them with `max by (replica)`, not `sum`.

Every metric carries `model_name`; request metrics also carry `priority`, the tier's
name (`protos/tiers.py` NAMES: `premium`, `standard`, `best_effort`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protos import tiers
from protos.continuum.v1 import scheduler_pb2

# `*_created` series double the exposition and no dashboard reads them.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                240.0, 480.0, 960.0)


class _ReplicaCollector(Collector):
    """Reads the replicas' latest Stats at scrape time."""

    def __init__(self, model_name: str, snapshot: Callable[[], Iterable[tuple[str, object]]]):
        self._model_name = model_name
        self._snapshot = snapshot

    def collect(self):
        labels = ["model_name", "replica"]
        running = GaugeMetricFamily("continuum:num_requests_running",
                                    "Sequences in the replica's running batch.",
                                    labels=[*labels, "priority"])
        waiting = GaugeMetricFamily("continuum:num_requests_waiting",
                                    "Requests queued (or swapped out) at the replica.",
                                    labels=[*labels, "priority"])
        kv = GaugeMetricFamily("continuum:kv_cache_usage_perc",
                               "Fraction of the replica's KV blocks in use (1 = full).",
                               labels=labels)
        preemptions = CounterMetricFamily("continuum:num_preemptions",
                                          "Preemptions at the replica since it started.",
                                          labels=labels)
        fallbacks = CounterMetricFamily(
            "continuum:scheduler_update_fallbacks",
            "Executor answers that did not list the samples the plan asked for (applied one "
            "sequence at a time); steady growth means an executor answers out of plan.",
            labels=labels)
        healthy = GaugeMetricFamily("continuum:replica_healthy",
                                    "1 if the gateway routes to the replica, else 0.",
                                    labels=labels)
        for address, replica in self._snapshot():
            ids = [self._model_name, address]
            healthy.add_metric(ids, 1.0 if replica.healthy else 0.0)
            stats: scheduler_pb2.StatsResponse | None = replica.stats
            if stats is None:
                continue
            for tier, name in enumerate(tiers.NAMES):
                by_running, by_waiting = stats.num_running_by_tier, stats.num_waiting_by_tier
                running.add_metric([*ids, name], by_running[tier] if tier < len(by_running) else 0)
                waiting.add_metric([*ids, name], by_waiting[tier] if tier < len(by_waiting) else 0)
            total = stats.num_total_blocks
            kv.add_metric(ids, 1 - stats.num_free_blocks / total if total else 0.0)
            preemptions.add_metric(ids, stats.num_preemptions)
            fallbacks.add_metric(ids, stats.num_update_fallbacks)
        yield from (running, waiting, kv, preemptions, fallbacks, healthy)


class GatewayMetrics:
    """One gateway's metrics in its own registry (tests run several gateways per process)."""

    def __init__(self, model_name: str,
                 replicas: Callable[[], Iterable[tuple[str, object]]] | None = None,
                 max_model_len: int | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        if max_model_len is not None:  # which model, how long a context: for dashboards
            Gauge("continuum:model_info", "The served model: always 1, its facts in labels.",
                  ["model_name", "max_model_len"], registry=self.registry
                  ).labels(model_name, str(max_model_len)).set(1)
        labels = ["model_name", "priority"]
        self.ttft = Histogram("continuum:time_to_first_token_seconds",
                              "Time from the gateway accepting a request to its first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("continuum:inter_token_latency_seconds",
                             "Time between consecutive token messages of a stream.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("continuum:e2e_request_latency_seconds",
                             "Time from accepting a request to its last message.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry)
        self.queue = Histogram("continuum:request_queue_time_seconds",
                               "Time waited in the scheduler queue before the first step.",
                               labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("continuum:prompt_tokens",
                                     "Prompt tokens of accepted requests.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("continuum:generation_tokens",
                                         "Tokens generated and sent to clients.",
                                         labels, registry=self.registry)
        self.success = Counter("continuum:request_success",
                               "Completions finished, by finish reason (stop, length, abort).",
                               [*labels, "finished_reason"], registry=self.registry)
        self.errors = Counter("continuum:request_errors",
                              "Requests ended with an error, by gRPC status code name.",
                              ["model_name", "code"], registry=self.registry)
        self.parse_errors = Counter(
            "continuum:request_parse_errors",
            "Requests whose parsing or validation raised something unexpected (answered "
            "400 by gateway/admit/parse_guard.py); any growth is a gap in a check, worth a look.",
            ["model_name", "api"], registry=self.registry)
        self.interventions = Counter(
            "continuum:stream_interventions",
            "Streams the gateway ended or moved on its own: replica_stalled (moved to another "
            "replica), slow_reader (client stopped reading: cancelled), shutdown (still "
            "running when drain's grace period ran out: ended with an error).",
            ["model_name", "reason"], registry=self.registry)
        if replicas is not None:
            self.registry.register(_ReplicaCollector(model_name, replicas))

    def labels(self, tier: int) -> tuple[str, str]:
        return self.model_name, tiers.name(tier)

    def error(self, code_name: str) -> None:
        self.errors.labels(self.model_name, code_name).inc()

    def parse_error(self, api: str) -> None:
        self.parse_errors.labels(self.model_name, api).inc()

    def intervention(self, reason: str) -> None:
        self.interventions.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

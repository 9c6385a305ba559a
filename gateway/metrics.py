"""The gateway's `/metrics` (families: runtime/metric_names.py `GATEWAY`).

Request metrics are measured here, where the client's experience is. Engine gauges come
from each replica's latest `Stats`, labelled by replica: gateways sharing replicas report
the same values, so aggregate with `max by (replica)`, not `sum`. Every family carries
`model_name`; request metrics also `priority`, the tier's name."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from protos import tiers
from protos.continuum.v1 import scheduler_pb2
from runtime import metric_names as names
from runtime.metrics import Metric


class GatewayMetrics:
    """One gateway's metrics, held per instance (tests run several gateways per process).
    Hot paths resolve a histogram's child once (`ttft.child(labels)`) and observe on it."""

    def __init__(self, model_name: str,
                 replicas: Callable[[], Iterable[tuple[str, object]]] | None = None,
                 max_model_len: int | None = None):
        self.model_name = model_name
        self._replicas = replicas
        self.model_info = Metric(names.GATEWAY_MODEL_INFO)
        if max_model_len is not None:  # which model, how long a context: for dashboards
            self.model_info.set((model_name, str(max_model_len)), 1)
        self.ttft = Metric(names.GATEWAY_TTFT)
        self.itl = Metric(names.GATEWAY_ITL)
        self.e2e = Metric(names.GATEWAY_E2E)
        self.queue = Metric(names.GATEWAY_QUEUE)
        self.prompt_tokens = Metric(names.GATEWAY_PROMPT_TOKENS)
        self.generation_tokens = Metric(names.GATEWAY_GENERATION_TOKENS)
        self.success = Metric(names.GATEWAY_SUCCESS)
        self.errors = Metric(names.GATEWAY_ERRORS)
        self.parse_errors = Metric(names.GATEWAY_PARSE_ERRORS)
        self.interventions = Metric(names.GATEWAY_INTERVENTIONS)

    def labels(self, tier: int) -> tuple[str, str]:
        return self.model_name, tiers.name(tier)

    def error(self, code_name: str) -> None:
        self.errors.inc((self.model_name, code_name))

    def parse_error(self, api: str) -> None:
        self.parse_errors.inc((self.model_name, api))

    def intervention(self, reason: str) -> None:
        self.interventions.inc((self.model_name, reason))

    def render(self) -> bytes:
        held = (self.model_info, self.ttft, self.itl, self.e2e, self.queue, self.prompt_tokens,
                self.generation_tokens, self.success, self.errors, self.parse_errors,
                self.interventions)
        replicas = _replica_lines(self.model_name, self._replicas) if self._replicas else ()
        return "".join([*(metric.lines() for metric in held), *replicas]).encode()


def _replica_lines(model_name: str, snapshot: Callable[[], Iterable[tuple[str, object]]]
                   ) -> list[str]:
    """The replicas' latest Stats, read at scrape time."""
    running, waiting, kv, preemptions, fallbacks, healthy = [], [], [], [], [], []
    for address, replica in snapshot():
        ids = (model_name, address)
        healthy.append((ids, 1.0 if replica.healthy else 0.0))
        stats: scheduler_pb2.StatsResponse | None = replica.stats
        if stats is None:
            continue
        by_running, by_waiting = stats.num_running_by_tier, stats.num_waiting_by_tier
        for tier, name in enumerate(tiers.NAMES):
            running.append(((model_name, name, address),
                            by_running[tier] if tier < len(by_running) else 0))
            waiting.append(((model_name, name, address),
                            by_waiting[tier] if tier < len(by_waiting) else 0))
        total = stats.num_total_blocks
        kv.append((ids, 1 - stats.num_free_blocks / total if total else 0.0))
        preemptions.append((ids, stats.num_preemptions))
        fallbacks.append((ids, stats.num_update_fallbacks))
    return [names.GATEWAY_REPLICA_RUNNING.lines(running),
            names.GATEWAY_REPLICA_WAITING.lines(waiting),
            names.GATEWAY_REPLICA_KV_USAGE.lines(kv),
            names.GATEWAY_REPLICA_PREEMPTIONS.lines(preemptions),
            names.GATEWAY_REPLICA_UPDATE_FALLBACKS.lines(fallbacks),
            names.GATEWAY_REPLICA_HEALTHY.lines(healthy)]

"""What a Kubernetes inference gateway (GIE, llm-d) tells us in headers: tenant and tier.

``x-llm-d-inference-fairness-id`` (or GIE's older ``x-gateway-inference-fairness-id``)
becomes the tenant, and ``x-llm-d-inference-objective`` (``x-gateway-inference-objective``)
the tier when it names one (the objective table, else a tier's own name), each only where
the request leaves it unset; other objective names are ignored. Neither grants anything:
the same key checks apply as to the body's fields (docs/usage.md, "API keys")."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway.validation import MAX_TENANT_CHARS, RequestError, check_identifier
from protos import tiers
from protos.continuum.v1 import generation_pb2

FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
# GIE's criticality words that are not our tier names (its "standard" is ours), as
# Priority values. They are the header's vocabulary, not a spelling of a tier: a body's
# `priority` or an API key's tiers do not take them.
DEFAULT_OBJECTIVE_TIERS: Mapping[str, int] = {
    "critical": tiers.to_priority(tiers.PREMIUM),
    "sheddable": tiers.to_priority(tiers.BEST_EFFORT),
}
MAX_OBJECTIVE_CHARS = 253  # a Kubernetes object name


def parse_objective_tiers(entries: list[str]) -> dict[str, int]:
    """The objective table: the defaults plus ``NAME=TIER`` entries (ValueError names a
    bad one, for the CLI to report)."""
    table = dict(DEFAULT_OBJECTIVE_TIERS)
    for entry in entries:
        name, sep, tier_text = entry.partition("=")
        name, tier = name.strip().lower(), tiers.parse(tier_text)
        if not sep or not name or tier is None:
            raise ValueError(f"--objective-tier {entry!r} must be NAME=TIER with TIER one of "
                             f"{', '.join(tiers.NAMES)}")
        table[name] = tiers.to_priority(tier)
    return table


def objective_priority(objective: str, objective_tiers: Mapping[str, int]) -> int | None:
    """The Priority an objective name stands for: the table's, else a tier's own name."""
    priority = objective_tiers.get(objective.lower())
    if priority is None and (tier := tiers.parse(objective)) is not None:
        priority = tiers.to_priority(tier)
    return priority


def _first(get: Callable[[str], str | None], names: tuple[str, ...]) -> tuple[str, str]:
    for name in names:
        value = get(name)
        if value:
            return name, value.strip()
    return "", ""


def apply(request: generation_pb2.GenerateRequest, get: Callable[[str], str | None],
          objective_tiers: Mapping[str, int] = DEFAULT_OBJECTIVE_TIERS) -> None:
    """Fills the request's tenant and priority from the headers ``get`` reads, where
    the request leaves them unset. RequestError (400) for a malformed header value."""
    name, fairness = _first(get, FAIRNESS_HEADERS)
    if fairness:
        check_identifier(fairness, f"{name} header", MAX_TENANT_CHARS)
        if not request.tenant:
            request.tenant = fairness
    name, objective = _first(get, OBJECTIVE_HEADERS)
    if objective:
        if len(objective) > MAX_OBJECTIVE_CHARS:
            raise RequestError(f"{name} header is {len(objective)} characters long; the limit "
                               f"is {MAX_OBJECTIVE_CHARS} (a Kubernetes object name)",
                               param=f"{name} header")
        priority = objective_priority(objective, objective_tiers)
        if priority is not None and request.priority == generation_pb2.PRIORITY_UNSPECIFIED:
            request.priority = priority


def metadata_getter(metadata) -> Callable[[str], str | None]:
    """``get`` over gRPC invocation metadata (keys arrive lower-case)."""
    values = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return values.get

"""What a Kubernetes inference gateway tells us in headers: the tenant and the tier.

The Gateway API Inference Extension (GIE) and llm-d's endpoint picker classify each
request before it reaches a model server and forward the classification in headers
(HTTP headers; gRPC metadata, which is the same thing on the wire):

* ``x-llm-d-inference-fairness-id`` (GIE's older ``x-gateway-inference-fairness-id``):
  the flow the request's fair share is kept for. It becomes the request's tenant when
  the request itself names none, so our per-tenant fairness follows the gateway's.
* ``x-llm-d-inference-objective`` (older ``x-gateway-inference-objective``): the name
  of the InferenceObjective the request belongs to. A name in the objective table
  (``--objective-tier NAME=TIER``; by default our tier names and the criticality
  names of GIE's v1alpha2 API: critical -> premium, standard, sheddable -> best
  effort) sets the priority tier when the request itself sets none. Other names are
  ignored: the endpoint picker has already used them for its own queueing.

Neither header grants anything: the tenant and tier they give go through the same key
checks as a tenant or priority in the body (gateway/admission.py), so a key bound to a
tenant still cannot act for another, and ``premium`` still needs a key that has it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway.validation import MAX_TENANT_CHARS, RequestError, check_identifier
from protos.continuum.v1 import generation_pb2

FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
TIER_VALUES = {"premium": generation_pb2.PRIORITY_PREMIUM,
               "standard": generation_pb2.PRIORITY_STANDARD,
               "best_effort": generation_pb2.PRIORITY_BEST_EFFORT}
DEFAULT_OBJECTIVE_TIERS: Mapping[str, int] = {
    **TIER_VALUES, "best-effort": generation_pb2.PRIORITY_BEST_EFFORT,
    "critical": generation_pb2.PRIORITY_PREMIUM,
    "sheddable": generation_pb2.PRIORITY_BEST_EFFORT,
}
MAX_OBJECTIVE_CHARS = 253  # a Kubernetes object name


def parse_objective_tiers(entries: list[str]) -> dict[str, int]:
    """The objective table: the defaults plus ``NAME=TIER`` entries (ValueError names a
    bad one, for the CLI to report)."""
    table = dict(DEFAULT_OBJECTIVE_TIERS)
    for entry in entries:
        name, sep, tier = entry.partition("=")
        name, tier = name.strip().lower(), tier.strip().lower()
        if not sep or not name or tier not in TIER_VALUES:
            raise ValueError(f"--objective-tier {entry!r} must be NAME=TIER with TIER one of "
                             f"{', '.join(TIER_VALUES)}")
        table[name] = TIER_VALUES[tier]
    return table


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
        tier = objective_tiers.get(objective.lower())
        if tier is not None and request.priority == generation_pb2.PRIORITY_UNSPECIFIED:
            request.priority = tier


def metadata_getter(metadata) -> Callable[[str], str | None]:
    """``get`` over gRPC invocation metadata (keys arrive lower-case)."""
    values = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return values.get

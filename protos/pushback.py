"""When a refused call may be tried again: the trailing metadata that says so, in one place.

A RESOURCE_EXHAUSTED or UNAVAILABLE to a client carries the same milliseconds twice:
``grpc-retry-pushback-ms`` (gRFC A6: gRPC's retry policy waits that long; never negative
here, every such refusal is worth retrying, docs/grpc.md) and ``retry-after-ms`` (the older
name, also the scheduler's hint in StreamError trailers). Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

PUSHBACK_KEY = "grpc-retry-pushback-ms"
RETRY_AFTER_KEY = "retry-after-ms"
# The status codes whose refusals carry the trailers (and the service config retries).
RETRYABLE_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})

Metadata = tuple[tuple[str, str], ...]


def trailers(delay_ms: float) -> Metadata:
    """Both trailers for a retry after ``delay_ms`` (rounded up, at least 0)."""
    value = str(max(0, math.ceil(delay_ms)))
    return ((PUSHBACK_KEY, value), (RETRY_AFTER_KEY, value))


def delay_ms(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The delay a status's metadata asks for (the standard key first), or None when it
    names none that is a non-negative whole number of milliseconds."""
    found = dict(metadata or ())
    for key in (PUSHBACK_KEY, RETRY_AFTER_KEY):
        value = found.get(key)
        if isinstance(value, str) and value.isdigit():
            return int(value)
    return None


def completed(code_name: str, metadata: Metadata, default_ms: float) -> Metadata:
    """``metadata`` for a client's status ``code_name``: for a retryable code, both trailers
    (with the delay it already names, else ``default_ms``) in place of either; other codes'
    metadata unchanged."""
    if code_name not in RETRYABLE_CODES:
        return metadata
    delay = delay_ms(metadata)
    rest = tuple((k, v) for k, v in metadata if k not in (PUSHBACK_KEY, RETRY_AFTER_KEY))
    return trailers(default_ms if delay is None else delay) + rest

"""The gateway's side of the internal Scheduler API: channel setup, how an upstream
stream ends (``StreamEnd``) and what the client is told of it."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from protos import pushback

# The scheduler's trailer on a request that failed by itself (a poison request):
# continuing it on another replica would only fail, or kill, that one too.
REQUEST_FAILED_KEY = "request-failed"
# The scheduler's trailer naming OpenAI's error code ("context_length_exceeded").
ERROR_CODE_KEY = "error-code"

# Fail fast while the scheduler is down (no wait_for_ready), but reconnect within about a
# second once it is back (gRPC's default backoff grows to two minutes). Keepalive pings,
# also while idle, give up a hung scheduler's connection (its calls then continue
# elsewhere); 10 s is grpc-go's floor for client pings, and the scheduler must permit it
# (KEEPALIVE_OPTIONS in scheduler_svc/__main__.py) or it answers GOAWAY "too_many_pings".
# The watchdog notices a stalled stream sooner; keepalive is the floor under it.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging a stream that sends nothing
)

# Upstream failures that mean "this replica cannot go on", not "this request is wrong":
# the relay continues the request on another replica.
REPLICA_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
})

# Codes whose upstream details are meaningful to the client as they are.
_PASS_THROUGH = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.INTERNAL,
    }
)


@dataclass(frozen=True)
class ClientStatus:
    """The status to end the client's call with after an upstream failure."""

    code: grpc.StatusCode
    message: str
    trailing_metadata: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How an upstream stream ended without its finish: the scheduler's status for it (a
    refusal, a request it ended), the call's break, or the deadline the gateway keeps.
    ``trailers`` carry the scheduler's hints: pushback, ``error-code``, ``request-failed``."""

    code: grpc.StatusCode
    details: str
    trailers: tuple[tuple[str, str], ...] = ()


def _retry_after(end: StreamEnd) -> tuple[tuple[str, str], ...]:
    """The scheduler's retry hint as the client's trailers (none when it gave none)."""
    delay = pushback.delay_ms(end.trailers)
    return () if delay is None else pushback.trailers(delay)


def client_status(end: StreamEnd, address: str) -> ClientStatus:
    """Maps an upstream stream's end to what the client should see."""
    code, details = end.code, end.details
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        message = details or "the server is overloaded; retry later"
        return ClientStatus(code, message, _retry_after(end))
    if code in _PASS_THROUGH:
        return ClientStatus(code, details, tuple(
            (key, value) for key, value in end.trailers if key == ERROR_CODE_KEY))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ClientStatus(code, "the deadline passed before generation finished")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ClientStatus(code, f"no scheduler replica reachable at {address} ({details})")
    # CANCELLED (it shut down), UNIMPLEMENTED (not a scheduler) and the rest: retry.
    return ClientStatus(
        grpc.StatusCode.UNAVAILABLE,
        f"the scheduler at {address} failed the request ({code.name}: {details})",
    )


def request_failed(end: StreamEnd) -> bool:
    """True when the scheduler ended the request because of the request itself."""
    return any(key == REQUEST_FAILED_KEY for key, _ in end.trailers)

"""Deny by default: the scheduler's gRPC service answers only callers that show
the per-deployment secret (``runtime/internal_auth.py``).

Every method but gRPC health checking (probes carry no secret; health reveals nothing)
needs ``x-continuum-internal-auth``; without it, or with a wrong one, a call ends
UNAUTHENTICATED before its request is parsed. Refusals are logged at most once per
``LOG_EVERY_S``, so a scanner cannot flood the log.
"""

from __future__ import annotations

import time

import grpc
import structlog
from grpc_health.v1 import health

from runtime import internal_auth

OPEN_METHOD_PREFIX = f"/{health.SERVICE_NAME}/"
UNAUTHENTICATED_MESSAGE = (
    f"this is an internal service: send the deployment's secret as metadata "
    f"{internal_auth.METADATA_KEY!r} (see {internal_auth.ENV_SECRET})"
)
LOG_EVERY_S = 10.0
_log = structlog.get_logger("scheduler.auth")


def _presented(metadata) -> str | None:
    return next((value for key, value in metadata or ()
                 if key == internal_auth.METADATA_KEY), None)


async def _deny(request_or_iterator, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


_DENY_HANDLERS = {  # (request_streaming, response_streaming) → how the refusal is served
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class InternalAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that lacks the secret, except health checks.

    ``secret`` None (the operator's explicit opt-out) lets everything through."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret
        self.num_refused = 0
        self._logged_at = float("-inf")

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or details.method.startswith(OPEN_METHOD_PREFIX)
                or internal_auth.check_token(self._secret,
                                             _presented(details.invocation_metadata))):
            return handler
        self.num_refused += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            _log.warning("refused an unauthenticated call", method=details.method,
                         num_refused=self.num_refused)
        make = _DENY_HANDLERS[(handler.request_streaming, handler.response_streaming)]
        # No deserializer: a refused request's bytes are never parsed.
        return make(_deny)

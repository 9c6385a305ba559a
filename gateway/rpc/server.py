"""The client-facing gRPC server: `Generation.Generate`, health and reflection.

Each call is admitted, run by the relay and written back event by event; when the call
ends early the relay's generator is closed, which cancels upstream so the scheduler frees
the request's KV blocks by its next step. Built here, bound and started by gateway/app.py."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.admit import routing_headers
from gateway.admit.admission import Admission
from gateway.admit.auth import UNAUTHENTICATED_MESSAGE, ApiKeys
from gateway.config import GatewayConfig
from gateway.edge.client_limits import RETRY_AFTER_MS, ClientLimits, grpc_peer_ip
from gateway.routing.relay import Relay, RelayError
from gateway.rpc.rpc_limit import RpcLimit, rebuild
from gateway.validation import (
    RequestError,
    UndecodableRequest,
    ValidatedRequest,
    parse_request,
)
from protos import pushback
from protos.continuum.v1 import generation_pb2, generation_pb2_grpc

_log = structlog.get_logger("gateway")
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# grpc reports "no deadline" as an enormous time remaining; do not forward that upstream.
_NO_DEADLINE_S = 10**7
_OPEN_METHOD_PREFIX = f"/{health.SERVICE_NAME}/"


def _upstream_timeout(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE_S:
        return None
    return max(remaining, 0.0)


def _trailers(code: grpc.StatusCode, metadata: pushback.Metadata = ()) -> pushback.Metadata:
    """A RESOURCE_EXHAUSTED or UNAVAILABLE end always carries the retry pushback trailers:
    the scheduler's delay where it named one, else RETRY_AFTER_MS."""
    return pushback.completed(code.name, metadata, RETRY_AFTER_MS)


def _authorization(metadata) -> str | None:
    return next((value for key, value in metadata or () if key == "authorization"), None)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Serves Generate for one model through the shared admit step and the relay."""

    def __init__(self, admission: Admission, relay: Relay, keys: ApiKeys,
                 clients: ClientLimits | None = None):
        self._admission = admission
        self._relay = relay
        self._keys = keys
        self._clients = clients or ClientLimits()

    async def Generate(self, request, context: grpc.aio.ServicerContext) -> None:
        metadata = context.invocation_metadata() or ()
        client = self._clients.client_of(grpc_peer_ip(context.peer() or ""), next(
            (value for key, value in metadata if key == "x-forwarded-for"), None))
        try:
            self._clients.acquire(client)
        except RequestError as exc:
            self._relay.metrics.error(exc.code.name)
            await context.abort(exc.code, exc.message, _trailers(exc.code))
        try:
            await self._generate(request, context)
        finally:
            self._clients.release(client)

    async def _generate(self, request, context: grpc.aio.ServicerContext) -> None:
        validated = await self._validate_or_abort(request, context)
        stream = self._relay.generate(validated, lambda: _upstream_timeout(context))
        try:
            async with contextlib.aclosing(stream):
                async for response in stream:
                    await context.write(response)
        except RelayError as exc:
            status = exc.status
            await context.abort(status.code, status.message, _trailers(status.code,
                                                                       status.trailing_metadata))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # a bug of ours after admission: INTERNAL, not grpc's UNKNOWN
            _log.exception("unexpected error while serving", request_id=validated.request_id)
            await self._internal(context, exc)

    async def _validate_or_abort(
        self, request: generation_pb2.GenerateRequest | UndecodableRequest, context
    ) -> ValidatedRequest:
        try:
            principal = self._keys.check(_authorization(context.invocation_metadata()))
            if principal is None:  # the interceptor refuses these first; kept as a backstop
                raise RequestError(UNAUTHENTICATED_MESSAGE, grpc.StatusCode.UNAUTHENTICATED)
            validated, _ = await self._admission.admit(
                principal, lambda: (request, None), api="grpc",
                request_id=getattr(request, "request_id", ""),
                headers=routing_headers.metadata_getter(context.invocation_metadata()))
            return validated
        except RequestError as exc:  # admit logged and counted it
            await context.abort(exc.code, exc.message, _trailers(exc.code))  # raises
            raise AssertionError("unreachable") from exc
        except Exception as exc:  # a bug of ours: INTERNAL with a generic message, logged
            _log.exception("unexpected error", request_id=getattr(request, "request_id", "")[:128])
            await self._internal(context, exc)

    async def _internal(self, context, exc: Exception):
        self._relay.metrics.error("INTERNAL")
        await context.abort(grpc.StatusCode.INTERNAL,
                            "internal server error; the request id is in the server log")
        raise AssertionError("unreachable") from exc


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """With API keys configured, refuses every call without a valid key except health."""

    def __init__(self, keys: ApiKeys):
        self._keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or details.method.startswith(_OPEN_METHOD_PREFIX)
                or self._keys.check(_authorization(details.invocation_metadata)) is not None):
            return handler

        async def deny(request_or_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        return rebuild(handler, deny)


def _server_options(config: GatewayConfig, max_body_bytes: int) -> list[tuple[str, int]]:
    """The client-facing server's channel arguments. Messages over `max_body_bytes` are
    RESOURCE_EXHAUSTED before our code runs; streams past the per-connection cap wait
    in the client (HTTP/2 flow control)."""
    options = [
        # SO_REUSEPORT (grpc's Linux default) would let a second gateway share a bound port.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_body_bytes),
        ("grpc.max_concurrent_streams", config.grpc_max_concurrent_streams),
        # Find dead peers by a ping a minute (grpc-go servers: 2 h), 20 s to answer.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]
    if config.grpc_max_connection_idle_s:
        options.append(("grpc.max_connection_idle_ms",
                        int(config.grpc_max_connection_idle_s * 1000)))
    return options


def _generation_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """Like the generated add_GenerationServicer_to_server, but with a deserializer that
    lets undecodable requests reach validation (INVALID_ARGUMENT, not UNKNOWN)."""
    generate = grpc.unary_stream_rpc_method_handler(
        servicer.Generate,
        request_deserializer=parse_request,
        response_serializer=generation_pb2.GenerateResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(GENERATION_SERVICE, {"Generate": generate})


def build_server(config: GatewayConfig, keys: ApiKeys, max_body_bytes: int
                 ) -> tuple[grpc.aio.Server, RpcLimit]:
    """The gRPC server, neither bound nor serving, and its cap on calls in flight (the
    caller sets `on_refuse` once metrics exist). Interceptors: the cap, then API keys."""
    limit = RpcLimit(config.grpc_max_concurrent_rpcs, _OPEN_METHOD_PREFIX)
    server = grpc.aio.server(
        options=_server_options(config, max_body_bytes),
        interceptors=[limit, *([_AuthInterceptor(keys)] if keys.enabled else [])],
        maximum_concurrent_rpcs=limit.total,  # grpc's own, a backstop: rpc_limit.py
    )
    return server, limit


def add_services(server: grpc.aio.Server, servicer: GenerationServicer
                 ) -> health.aio.HealthServicer:
    """Generate (through ``servicer``), health and reflection on ``server``; health
    answers SERVING only after `mark_serving`."""
    server.add_generic_rpc_handlers((_generation_handler(servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return health_servicer


async def mark_serving(health_servicer: health.aio.HealthServicer) -> None:
    """Health SERVING for the server as a whole and for Generate."""
    for service in ("", GENERATION_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)

"""The client-facing gRPC server: `Generation.Generate`, health and reflection.

Each Generate call is validated, submitted to the scheduler as one
`Scheduler.Submit` server stream, and relayed back event by event. The upstream
call is cancelled in a `finally` whenever the client's call ends early (client
gone, deadline passed, stop string matched), so the scheduler frees the
request's KV blocks by its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from dataclasses import dataclass

import grpc
import structlog
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway import routing_headers
from gateway.admission import Admission
from gateway.auth import UNAUTHENTICATED_MESSAGE, ApiKeys
from gateway.client_limits import RETRY_AFTER_MS, ClientLimits, grpc_peer_ip, parse_networks
from gateway.config import GatewayConfig
from gateway.http_api import HttpApi, start_http
from gateway.http_edge import HttpLimits
from gateway.metrics import GatewayMetrics
from gateway.probes import Probes, start_probes
from gateway.relay import DRAINING, END_S, Relay, RelayError, end_after_grace
from gateway.replicas import ReplicaSet
from gateway.rpc_limit import RpcLimit
from gateway.tokenizer import Tokenizer
from gateway.upstream import RETRY_AFTER_KEY
from gateway.validation import (
    RequestError,
    UndecodableRequest,
    ValidatedRequest,
    parse_request,
)
from gateway.watchdog import Watchdog
from protos.continuum.v1 import generation_pb2, generation_pb2_grpc
from runtime.tls import ServerTls, add_port, channel_credentials

_log = structlog.get_logger("gateway")
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# grpc reports "no deadline" as an enormous time remaining; do not forward that upstream.
_NO_DEADLINE_S = 10**7
_OPEN_METHOD_PREFIX = f"/{health.SERVICE_NAME}/"


class BindError(Exception):
    """The listening address could not be bound; the message names the fix."""


def _upstream_timeout(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE_S:
        return None
    return max(remaining, 0.0)


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
            await context.abort(exc.code, exc.message,
                                ((RETRY_AFTER_KEY, str(RETRY_AFTER_MS)),))
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
            await context.abort(status.code, status.message, status.trailing_metadata)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # a bug of ours after admission: INTERNAL, not grpc's UNKNOWN
            _log.exception("unexpected error while serving", request_id=validated.request_id)
            self._relay.metrics.error("INTERNAL")
            await context.abort(grpc.StatusCode.INTERNAL,
                                "internal server error; the request id is in the server log")
            raise AssertionError("unreachable") from exc

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
            await context.abort(exc.code, exc.message)  # raises: ends the call
            raise AssertionError("unreachable") from exc
        except Exception as exc:  # a bug of ours: INTERNAL with a generic message, logged
            _log.exception("unexpected error", request_id=getattr(request, "request_id", "")[:128])
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

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def _server_options(config: GatewayConfig, max_body_bytes: int) -> list[tuple[str, int]]:
    """Channel arguments of the client-facing gRPC server (see GatewayConfig for the
    references each default follows). Messages over `max_body_bytes` are
    RESOURCE_EXHAUSTED before any of our code runs; streams past the per-connection
    cap wait in the client (HTTP/2 flow control), they are not refused."""
    options = [
        # SO_REUSEPORT (grpc's default on Linux) would let a second gateway bind a
        # port that is already in use and silently share its traffic.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_body_bytes),
        ("grpc.max_concurrent_streams", config.grpc_max_concurrent_streams),
        # Dead peers are found by pinging every minute (grpc-go servers: 2 h), and a
        # connection that does not answer within 20 s is closed with its streams.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]
    if config.grpc_max_connection_idle_s:
        options.append(("grpc.max_connection_idle_ms",
                        int(config.grpc_max_connection_idle_s * 1000)))
    return options


def _probe_bind(host: str, port: int) -> None:
    """Raises BindError if (host, port) cannot be listened on.

    Probing with a plain socket first gives a precise reason and keeps grpc's
    own multi-line bind error off stderr. SO_REUSEADDR matches grpc, so sockets
    left in TIME_WAIT by a previous run do not count as "in use".
    """
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}; pass --host") from exc
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise BindError(f"port {port} is already in use; pass --port") from exc
                raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


def _bind(server: grpc.aio.Server, host: str, port: int, tls: ServerTls | None) -> int:
    """Binds the gRPC port (over TLS when ``tls``); raises BindError, or TlsError for
    certificate files that cannot be used."""
    if port != 0:
        _probe_bind(host, port)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = add_port(server, address, tls)
    except RuntimeError as exc:  # lost a race for the port since the probe
        raise BindError(f"cannot listen on {address}; is port {port} in use? pass --port") from exc
    if bound == 0:
        raise BindError(f"cannot listen on {address}; is port {port} in use? pass --port")
    return bound


def _scheduler_credentials(config: GatewayConfig) -> grpc.ChannelCredentials | None:
    """TLS to the scheduler replicas, or None (plaintext); raises TlsError."""
    if config.scheduler_tls_ca_file is None:
        return None
    return channel_credentials(config.scheduler_tls_ca_file,
                               config.scheduler_tls_client_cert_file,
                               config.scheduler_tls_client_key_file)


def _generation_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """Like the generated add_GenerationServicer_to_server, but with a deserializer that
    lets undecodable requests reach validation (INVALID_ARGUMENT, not UNKNOWN)."""
    generate = grpc.unary_stream_rpc_method_handler(
        servicer.Generate,
        request_deserializer=parse_request,
        response_serializer=generation_pb2.GenerateResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(GENERATION_SERVICE, {"Generate": generate})


@dataclass
class RunningGateway:
    """A started gateway; `stop()` drains it (health first, then calls, then upstream)."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    replicas: ReplicaSet
    port: int
    metrics: GatewayMetrics
    http: HttpApi | None = None
    http_runner: web.AppRunner | None = None
    http_port: int | None = None
    relay: Relay | None = None
    probe_runner: web.AppRunner | None = None
    probe_port: int | None = None
    stopping: bool = False

    async def stop(self, grace_s: float) -> None:
        """New calls are refused at once (UNAVAILABLE / 503); in-flight ones get grace_s
        to finish. Whatever still runs then gets a terminal answer, not a cut
        connection: gRPC streams end UNAVAILABLE with a message, SSE streams with an
        `error` event and `[DONE]`; only a client that does not take even that within
        END_S more is cut."""
        self.stopping = True  # the probe listener's /health answers 503 from here
        if self.relay is not None:  # first, so that health NOT_SERVING implies refusal
            self.relay.refuse_new(DRAINING)
        await self.health.enter_graceful_shutdown()
        drains = [self.http.drain(grace_s)] if self.http is not None else []
        if self.relay is not None:
            drains.append(end_after_grace(self.relay, grace_s))
        await asyncio.gather(*drains)
        # The server is stopped only now: until here new calls got the relay's clear
        # UNAVAILABLE, not a call cancelled by a server shutting down under it.
        await self.server.stop(END_S if self.relay is not None else grace_s)
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        if self.relay is not None:
            await self.relay.close()
        await self.replicas.close()
        if self.probe_runner is not None:  # last: /live answers while the rest drains
            await self.probe_runner.cleanup()


async def start_gateway(config: GatewayConfig, tokenizer: Tokenizer,
                        keys: ApiKeys | None = None) -> RunningGateway:
    """Binds, starts serving and marks health SERVING; raises BindError."""
    keys = keys or ApiKeys()
    if config.allow_special_tokens_in_content:
        tokenizer = tokenizer.trusting_content()  # every path: chat, /tokenize
    max_body_bytes = config.body_limit(tokenizer.info.max_model_len)
    limit = RpcLimit(config.grpc_max_concurrent_rpcs, _OPEN_METHOD_PREFIX)
    server = grpc.aio.server(
        options=_server_options(config, max_body_bytes),
        interceptors=[limit, *([_AuthInterceptor(keys)] if keys.enabled else [])],
        maximum_concurrent_rpcs=limit.total,  # grpc's own, a backstop: rpc_limit.py
    )
    port = _bind(server, config.host, config.port, config.server_tls)
    if config.http_port:
        _probe_bind(config.host, config.http_port)
    replicas = ReplicaSet(config.scheduler_addresses, credentials=_scheduler_credentials(config),
                          server_name=config.scheduler_tls_server_name)
    metrics = GatewayMetrics(config.model_name, replicas.snapshot, tokenizer.info.max_model_len)
    limit.on_refuse = metrics.error  # the server needed the limit before metrics existed
    watchdog = Watchdog(metrics.intervention, progress_timeout_s=config.stream_progress_timeout_s,
                        write_stall_s=config.slow_reader_timeout_s)
    relay = Relay(tokenizer, replicas, metrics, watchdog=watchdog)
    admission = Admission(tokenizer, config.model_name, metrics,
                          routing_headers.parse_objective_tiers(list(config.objective_tiers)))
    clients = ClientLimits(config.http_max_connections_per_client,
                           config.max_streams_per_client,
                           parse_networks(config.trusted_proxies))
    servicer = GenerationServicer(admission, relay, keys, clients)
    server.add_generic_rpc_handlers((_generation_handler(servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    running = RunningGateway(server, health_servicer, replicas, port, metrics, relay=relay)
    await _start_listeners(running, config, HttpApi(
        relay, admission, tokenizer, config.model_name, keys, metrics, replicas,
        _http_limits(config, max_body_bytes, clients), config.tool_call_parser))
    await server.start()
    replicas.start()
    for service in ("", GENERATION_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return running


def _http_limits(config: GatewayConfig, max_body_bytes: int, clients: ClientLimits
                 ) -> HttpLimits:
    return HttpLimits(max_body_bytes=max_body_bytes,
                      header_timeout_s=config.http_header_timeout_s,
                      body_timeout_s=config.http_body_timeout_s,
                      max_connections=config.http_max_connections,
                      lingering_s=config.http_lingering_s,
                      keepalive_s=config.http_keepalive_timeout_s, clients=clients)


async def _start_listeners(running: RunningGateway, config: GatewayConfig, http: HttpApi
                           ) -> None:
    """The HTTP API (when --http-port is set) and the probe listener (--probe-port)."""
    if config.http_port is not None:
        running.http = http
        try:
            running.http_runner, running.http_port = await start_http(
                http, config.host, config.http_port,
                None if config.server_tls is None else config.server_tls.ssl_context())
        except OSError as exc:
            raise BindError(f"cannot listen on {config.host}:{config.http_port} for HTTP "
                            f"({exc.strerror}); pass --http-port") from exc
    if config.probe_port is not None:
        probes = Probes(lambda: running.stopping, lambda: running.replicas.any_healthy)
        try:
            running.probe_runner, running.probe_port = await start_probes(
                probes, config.host, config.probe_port)
        except OSError as exc:
            raise BindError(f"cannot listen on {config.host}:{config.probe_port} for probes "
                            f"({exc.strerror}); pass --probe-port") from exc

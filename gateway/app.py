"""One gateway, wired: the gRPC server, the OpenAI HTTP API and the probe listener in front
of one relay. Every port is bound before anything talks to a replica, so a port in use is
one `BindError` line at startup."""

from __future__ import annotations

import asyncio
import errno
import socket
from dataclasses import dataclass

import grpc
from aiohttp import web
from grpc_health.v1 import health

from gateway.admit import routing_headers
from gateway.admit.admission import Admission
from gateway.admit.auth import ApiKeys
from gateway.api.http_api import HttpApi, start_http
from gateway.config import GatewayConfig
from gateway.edge.client_limits import ClientLimits, parse_networks
from gateway.edge.http_edge import HttpLimits
from gateway.edge.probes import Probes, start_probes
from gateway.metrics import GatewayMetrics
from gateway.routing.relay import DRAINING, END_S, Relay, end_after_grace
from gateway.routing.replicas import ReplicaSet
from gateway.routing.watchdog import Watchdog
from gateway.rpc.server import GenerationServicer, add_services, build_server, mark_serving
from gateway.text.tokenizer import Tokenizer
from runtime.tls import ServerTls, add_port, channel_credentials


class BindError(Exception):
    """The listening address could not be bound; the message names the fix."""


def _probe_bind(host: str, port: int) -> None:
    """Raises BindError if (host, port) cannot be listened on: a plain socket gives a precise
    reason where grpc prints a multi-line error. SO_REUSEADDR as grpc: TIME_WAIT is not use."""
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
    except RuntimeError:  # lost a race for the port since the probe
        bound = 0
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
        """New calls are refused at once (UNAVAILABLE / 503); in-flight ones get grace_s,
        then a terminal answer (UNAVAILABLE, or an SSE `error` and `[DONE]`) within END_S."""
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
    server, limit = build_server(config, keys, max_body_bytes)
    port = _bind(server, config.host, config.port, config.server_tls)
    if config.http_port > 0:
        _probe_bind(config.host, config.http_port)
    replicas = ReplicaSet(config.scheduler_addresses, credentials=_scheduler_credentials(config),
                          server_name=config.scheduler_tls_server_name,
                          max_call_age_s=config.upstream_call_max_age_s)
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
    health_servicer = add_services(server, servicer)
    running = RunningGateway(server, health_servicer, replicas, port, metrics, relay=relay)
    await _start_listeners(running, config, HttpApi(
        relay, admission, tokenizer, config.model_name, keys, metrics, replicas,
        _http_limits(config, max_body_bytes, clients), config.tool_call_parser))
    await server.start()
    replicas.start()
    await mark_serving(health_servicer)
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
    if config.http_port >= 0:
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

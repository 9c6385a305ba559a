"""``python -m scheduler_svc``: one scheduler replica.

Binds the executor channel (ZeroMQ ROUTER on --ipc) and the internal gRPC
Scheduler service (--scheduler-host/--scheduler-port), then runs the step loop until SIGTERM.
Both planes need the per-deployment secret (``runtime/internal_auth.py``):
without one, and without the explicit opt-out, the process refuses to start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import stat
import sys
import time

import grpc
import structlog
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.continuum.v1 import scheduler_pb2_grpc
from runtime import config_flags, internal_auth, tls
from runtime.log_setup import configure_logging
from scheduler_svc import config_file, metrics
from scheduler_svc.admin import ConfigAdmin, SchedulerAdminServicer
from scheduler_svc.auth import InternalAuthInterceptor
from scheduler_svc.core import ConfigError, SchedulerConfig
from scheduler_svc.kv_events import KVEventPublisher
from scheduler_svc.loop import EngineLoop
from scheduler_svc.process_config import SchedulerProcessConfig
from scheduler_svc.servicer import SchedulerServicer
from scheduler_svc.telemetry import Recorder
from telemetry import Retention, StoreError, TelemetryStore, TelemetryWriter

SERVICE_NAME = "continuum.v1.Scheduler"
# Gateways ping every 10 s to notice a hung scheduler (gateway/routing/upstream.py): permit
# that (half the interval, so jitter is no strike), and ping gateways in turn, so
# the streams of one that vanished without closing are cancelled and their KV freed.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)
# A backstop far above what admission lets in (max_num_seqs + max_num_waiting, 64 +
# 1,024 by default), for calls it never sees (health watches, calls in the auth
# check, a gateway gone wrong): past it grpc answers RESOURCE_EXHAUSTED itself.
MAX_CONCURRENT_RPCS = 16_384
log = structlog.get_logger("scheduler")


def parse_args(argv: list[str] | None = None) -> SchedulerProcessConfig:
    parser = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    return config_flags.parse(SchedulerProcessConfig, parser, argv, ConfigError)


def start_kv_events(args: SchedulerProcessConfig, loop: EngineLoop) -> KVEventPublisher | None:
    """The KV event publisher of --kv-events-endpoint, attached to the loop's core
    before any executor attaches (None without the flag)."""
    if not args.kv_events_endpoint:
        return None
    try:
        publisher = KVEventPublisher(
            args.kv_events_endpoint, topic=args.kv_events_topic,
            replay_endpoint=args.kv_events_replay_endpoint, connect=args.kv_events_connect,
            allow_remote=args.kv_events_allow_remote)
    except (ValueError, zmq.ZMQError) as exc:
        fail(f"cannot publish KV events on {args.kv_events_endpoint}: {exc}")
    publisher.attach(loop.core)
    log.info("kv events publishing", endpoint=publisher.endpoint, topic=args.kv_events_topic,
             replay=args.kv_events_replay_endpoint or None)
    return publisher


def fail(message: str) -> None:
    print(f"scheduler: {message}", file=sys.stderr)
    sys.exit(2)


def load_secret(host: str) -> bytes | None:
    """The internal secret, or None under the opt-out (warned about off loopback)."""
    try:
        secret = internal_auth.load_secret()
    except internal_auth.SecretError as exc:
        fail(str(exc))
    if secret is None:
        log.warning("internal auth is OFF: anyone who can reach the port may submit, abort "
                    "and read stats", opt_out=internal_auth.ENV_INSECURE, host=host,
                    loopback=host in ("127.0.0.1", "localhost", "::1"))
    return secret


def private_ipc_dir(ipc: str) -> None:
    """Creates an ``ipc://`` socket's directory with mode 0700 when it is missing (the
    Kubernetes layout names one inside the pod's shared emptyDir); warns when the
    directory is writable by others, who could then take the socket's place."""
    if not ipc.startswith("ipc://"):
        return
    directory = os.path.dirname(os.path.abspath(ipc.removeprefix("ipc://")))
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        mode = stat.S_IMODE(os.stat(directory).st_mode)
    except OSError as exc:
        fail(f"cannot use the directory of the executor channel {ipc}: {exc.strerror}")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("the executor channel's directory is writable by other users; "
                    "use a private one (mode 0700)", directory=directory, mode=f"{mode:o}")


async def serve(args: SchedulerProcessConfig, config: SchedulerConfig,
                server_tls: tls.ServerTls | None, secret: bytes | None,
                file_bytes: bytes = b"") -> None:
    """``config``: the startup config (``args.core`` under the config file's fields)."""
    private_ipc_dir(args.ipc)
    loop = EngineLoop(config, args.ipc, secret=secret, plan_channel=args.plan_channel,
                      heartbeat_timeout_s=args.executor_heartbeat_timeout_s)
    loop.recorder = open_telemetry(args, config)
    kv_events = start_kv_events(args, loop)
    admin = ConfigAdmin(loop, config, args.core, source="command line" + (
        f" and {args.config_file}" if args.config_file else ""),
        first_version=last_config_version(args.telemetry_dsn) + 1 if loop.recorder else 1)
    try:
        loop.start()
    except zmq.ZMQError as exc:
        fail(f"cannot bind the executor channel {args.ipc}: {exc}")
    server = grpc.aio.server(
        options=KEEPALIVE_OPTIONS, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        interceptors=None if secret is None else [InternalAuthInterceptor(secret)])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(loop), server)
    scheduler_pb2_grpc.add_SchedulerAdminServicer_to_server(SchedulerAdminServicer(admin),
                                                            server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        tls.add_port(server, f"{args.scheduler_host}:{args.scheduler_port}", server_tls)
    except RuntimeError:
        fail(f"port {args.scheduler_port} on {args.scheduler_host} is already in use; pass "
             "--scheduler-port")
    await server.start()
    frozen = loop.gc.take_over()  # start-up is done: collect off the step path (gc_pacing.py)
    log.info("scheduler listening", address=f"{args.scheduler_host}:{args.scheduler_port}",
             ipc=args.ipc, tls=server_tls is not None, gc_frozen_objects=frozen)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    tasks = [asyncio.get_running_loop().create_task(report_health(loop, health_servicer))]
    if args.config_file:
        tasks.append(asyncio.get_running_loop().create_task(
            config_file.watch(args.config_file, file_bytes, admin.apply_file)))
    metrics_server = start_metrics(args, loop, tasks)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopping, loop.fatal], return_when=asyncio.FIRST_COMPLETED)
    if loop.fatal.done():
        await die(loop, server, health_servicer, loop.fatal.result())
    await drain(loop, server, health_servicer, args.grace_period)
    for task in tasks:
        task.cancel()
    if metrics_server is not None:
        metrics_server.stop()
    await loop.stop()
    if kv_events is not None:
        kv_events.close()
    if loop.recorder is not None:
        await asyncio.to_thread(loop.recorder.writer.close, 5.0)


def start_metrics(args: SchedulerProcessConfig, loop: EngineLoop,
                  tasks: list) -> metrics.MetricsServer | None:
    """The replica's /metrics (scheduler_svc/metrics.py) when --metrics-port is set."""
    if args.metrics_port < 0:
        return None
    try:
        server = metrics.MetricsServer(args.metrics_host, args.metrics_port)
    except OSError as exc:
        fail(f"cannot serve /metrics on {args.metrics_host}:{args.metrics_port}: "
             f"{exc.strerror}; pass another --metrics-port")
    server.start()
    tasks.append(asyncio.get_running_loop().create_task(
        metrics.publish(loop, loop.histograms, server)))
    log.info("metrics listening", address=f"{args.metrics_host}:{server.port}")
    return server


def open_telemetry(args: SchedulerProcessConfig, config: SchedulerConfig) -> Recorder | None:
    """The telemetry recorder of ``--telemetry-dsn`` (None without one); a store that
    cannot be opened or migrated is a one-line startup error (exit 2)."""
    if not args.telemetry_dsn:
        return None
    max_age_s = args.telemetry_retention_days * 86400
    retention = Retention(max_age_s=max_age_s, raw_iterations_s=min(3600.0, max_age_s))
    try:
        writer = TelemetryWriter.open(args.telemetry_dsn, retention=retention)
    except StoreError as exc:
        fail(f"cannot open the telemetry store: {exc}")
    recorder = Recorder(writer)  # ConfigAdmin records the startup config as version 1
    log.info("telemetry on", store=writer.target, retention_days=args.telemetry_retention_days)
    return recorder


def last_config_version(dsn: str) -> int:
    """The telemetry store's newest config version (0: none): a restarted scheduler
    numbers its versions after it, since the version is the table's primary key."""
    try:
        with TelemetryStore.open(dsn, migrate=False) as store:
            (newest,), = store.query("SELECT MAX(version) FROM scheduler_config")
    except StoreError as exc:
        log.warning("cannot read the store's config versions; numbering from 1", why=str(exc))
        return 0
    return newest or 0


async def report_health(loop: EngineLoop, health_servicer) -> None:
    """SERVING means progress is possible: NOT_SERVING while there is work
    and no executor, and while draining."""
    serving = None
    while True:
        now = not loop.draining and (loop.executor is not None or not loop.has_work)
        if now != serving:
            serving = now
            status = (health_pb2.HealthCheckResponse.SERVING if now
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)
        await asyncio.sleep(0.25)


async def drain(loop: EngineLoop, server, health_servicer, grace_s: float) -> None:
    """Refuse new work (UNAVAILABLE), let in-flight requests finish within the
    grace period, then stop; whatever is left is aborted by the server stop."""
    log.info("scheduler draining", in_flight=len(loop.core.requests), grace_s=grace_s)
    loop.draining = True
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = time.monotonic() + grace_s
    while loop.has_work and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    # Past the grace period every stream still open gets a terminal answer (UNAVAILABLE
    # with this message: a gateway continues it on another replica), not a cut stream.
    unfinished = loop.abort_all(f"this scheduler replica shut down before the request "
                                f"finished (grace period {grace_s:g} s); retry on another")
    await server.stop(grace=1)
    log.info("scheduler stopped", unfinished=unfinished)


async def die(loop: EngineLoop, server, health_servicer, why: str) -> None:
    """A task the loop depends on died (EngineLoop.fatal): report NOT_SERVING, end every
    stream with UNAVAILABLE and exit 1, so the supervisor or Kubernetes restarts us."""
    log.error("scheduler exiting after a fatal error", why=why)
    loop.draining = True
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        loop.abort_all(f"this scheduler replica failed ({why}); retry on another")
    except Exception:  # the state it would abort may be what broke
        log.exception("could not end the open streams")
    await server.stop(grace=1)
    await loop.stop()
    raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("scheduler")
    config, file_bytes = args.core, b""
    try:
        if args.config_file:
            values, file_bytes = config_file.load(args.config_file)
            try:
                config = config_file.overlay(args.core, values)
            except ConfigError as exc:
                raise ConfigError(f"with the config file {args.config_file}: {exc}") from None
    except ConfigError as exc:
        fail(str(exc))
    secret = load_secret(args.scheduler_host)
    try:  # read now: a bad file is a startup error, not a failed first handshake
        server_tls = tls.server_tls(args.scheduler_tls_cert_file, args.scheduler_tls_key_file,
                                    args.scheduler_tls_client_ca_file, prefix="--scheduler-tls")
        if server_tls is not None:
            server_tls.load()
    except tls.TlsError as exc:
        fail(str(exc))
    if server_tls is None and args.scheduler_host not in tls.LOOPBACK:
        log.warning("plaintext off loopback: the internal secret crosses the network in "
                    "clear; pass --scheduler-tls-cert-file and --scheduler-tls-key-file",
                    host=args.scheduler_host)
    asyncio.run(serve(args, config, server_tls, secret, file_bytes))


if __name__ == "__main__":
    main()

"""``python -m scheduler_svc``: one scheduler replica.

Binds the executor channel (ZeroMQ ROUTER on --ipc) and the internal gRPC
Scheduler service (--host/--port), then runs the step loop until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

import grpc
import structlog
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.continuum.v1 import scheduler_pb2_grpc
from scheduler_svc.core import ConfigError, SchedulerConfig
from scheduler_svc.loop import EngineLoop
from scheduler_svc.servicer import SchedulerServicer

SERVICE_NAME = "continuum.v1.Scheduler"
log = structlog.get_logger("scheduler")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    p.add_argument("--ipc", required=True, help="executor channel, e.g. ipc:///tmp/continuum.sock")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    p.add_argument("--port", type=int, default=50061, help="gRPC port for gateways")
    add_config_flags(p)
    return p.parse_args(argv)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SchedulerConfig field (--max-num-seqs, --policy, ...)."""
    for field in dataclasses.fields(SchedulerConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = {"int": int, "float": float, "str": str}[str(field.type)]
            p.add_argument(flag, type=kind, default=field.default)


def config_from(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(**{f.name: getattr(args, f.name)
                              for f in dataclasses.fields(SchedulerConfig)})


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def fail(message: str) -> None:
    print(f"scheduler: {message}", file=sys.stderr)
    sys.exit(2)


async def serve(args: argparse.Namespace, config: SchedulerConfig) -> None:
    loop = EngineLoop(config, args.ipc)
    try:
        loop.start()
    except zmq.ZMQError as exc:
        fail(f"cannot bind the executor channel {args.ipc}: {exc}")
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(loop), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        server.add_insecure_port(f"{args.host}:{args.port}")
    except RuntimeError:
        fail(f"port {args.port} on {args.host} is already in use; pass --port")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("scheduler listening", address=f"{args.host}:{args.port}", ipc=args.ipc)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("scheduler stopping")
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5)
    await loop.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging()
    try:
        config = config_from(args)
    except ConfigError as exc:
        fail(str(exc))
    asyncio.run(serve(args, config))


if __name__ == "__main__":
    main()

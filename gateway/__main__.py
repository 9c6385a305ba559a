"""`python -m gateway --model-dir DIR --scheduler HOST:PORT`: run one gateway.

Startup failures a user can fix (port in use, no tokenizer.json, bad flag)
end with one line on stderr and exit code 2, never a traceback. SIGTERM or
SIGINT drains: health goes NOT_SERVING, new calls are refused, in-flight calls
get the grace period, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import signal
import sys

import structlog

from gateway.admit.auth import ApiKeys
from gateway.admit.routing_headers import DEFAULT_OBJECTIVE_TIERS
from gateway.app import BindError, start_gateway
from gateway.config import ConfigError, GatewayConfig
from gateway.edge import edge_flags
from gateway.text.tokenizer import ModelFilesError, Tokenizer
from protos import tiers
from runtime.gc_freeze import freeze_start_up
from runtime.internal_auth import SecretError, load_secret
from runtime.log_setup import configure_logging
from runtime.tls import LOOPBACK, TlsError

EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> GatewayConfig:
    return _config_from(_parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model-dir",
        required=True,
        type=pathlib.Path,
        help="Hugging Face-format model directory (tokenizer.json, config.json)",
    )
    parser.add_argument(
        "--scheduler",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="scheduler replica(s); requests go to the least-loaded healthy one. "
        "dns:///NAME:PORT: every address NAME resolves to, re-resolved every 5 s "
        "(a Kubernetes headless Service)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (0: any)")
    parser.add_argument("--model-name", default="",
                        help="model name clients may send (default: the model dir's name)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context limit (default: config.json max_position_embeddings)")
    parser.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="OpenAI-compatible HTTP API port (0: any free port; -1: no HTTP server)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest HTTP body / gRPC message (default: 32 B a context token, >= 1 MiB)",
    )
    parser.add_argument(
        "--api-keys-file",
        type=pathlib.Path,
        default=None,
        help="require API keys: one KEY, KEY:TENANT, KEY:TENANT:TIERS or "
        "KEY:TENANT:TIERS:GRANTS per line (TIERS e.g. premium+standard+best_effort; GRANTS: "
        "special_tokens; also env CONTINUUM_API_KEYS)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=5.0,
        help="seconds in-flight calls may run on after SIGTERM",
    )
    parser.add_argument(
        "--objective-tier", action="append", default=[], metavar="NAME=TIER",
        help="an inference gateway objective (x-llm-d-inference-objective header) that maps "
             "to a tier, beside "
             f"{'/'.join((*tiers.NAMES, *DEFAULT_OBJECTIVE_TIERS))}; repeatable")
    edge_flags.add_flags(parser)
    return parser


def _config_from(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        model_dir=args.model_dir,
        scheduler_address=args.scheduler,
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        max_model_len=args.max_model_len,
        grace_period_s=args.grace_period,
        http_port=None if args.http_port < 0 else args.http_port,
        max_body_bytes=args.max_body_bytes,
        api_keys_file=args.api_keys_file,
        objective_tiers=tuple(args.objective_tier),
        **edge_flags.config_fields(args),
    )


async def serve(config: GatewayConfig, tokenizer: Tokenizer, keys: ApiKeys) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        # Installed before binding, so a signal during startup still drains cleanly.
        loop.add_signal_handler(signum, stop.set)
    gateway = await start_gateway(config, tokenizer, keys)
    frozen = freeze_start_up()  # tokenizer, templates, imports: never traversed again
    log = structlog.get_logger("gateway")
    log.info(
        "gateway serving",
        host=config.host,
        port=gateway.port,
        http_port=gateway.http_port,
        tls="mutual" if config.tls_client_ca_file else "on" if config.tls_cert_file else "off",
        probe_port=gateway.probe_port,
        auth="api keys" if keys.enabled else "off",
        model=config.model_name,
        scheduler=config.scheduler_address,
        max_model_len=tokenizer.info.max_model_len,
        gc_frozen_objects=frozen,
    )
    if config.server_tls is None and config.host not in LOOPBACK:
        log.warning("plaintext off loopback: API keys and prompts cross the network in "
                    "clear; pass --tls-cert-file and --tls-key-file", host=config.host)
    await stop.wait()
    log.info("draining", grace_period_s=config.grace_period_s)
    await gateway.stop(config.grace_period_s)
    log.info("gateway stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
        load_secret()  # fail fast; the ReplicaSet reads it again for its channels
        tokenizer = Tokenizer.from_dir(config.model_dir, max_model_len=config.max_model_len)
        tokenizer.guided.warm()  # structured-output compile workers, ~1 s in the background
        keys = ApiKeys.load(config.api_keys_file)
        configure_logging("gateway")
        try:
            asyncio.run(serve(config, tokenizer, keys))
        finally:
            tokenizer.guided.close()
    except (ConfigError, ModelFilesError, BindError, SecretError, TlsError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

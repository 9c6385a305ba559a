"""`python -m gateway --model-dir DIR --scheduler HOST:PORT`: run one gateway.

A startup failure a user can fix ends with one stderr line and exit 2; SIGTERM/SIGINT
drains (health NOT_SERVING, new calls refused, grace period), then exits 0."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import structlog

from gateway.admit.auth import ApiKeys
from gateway.app import BindError, start_gateway
from gateway.config import ConfigError, GatewayConfig
from gateway.text.tokenizer import ModelFilesError, Tokenizer
from runtime import config_flags
from runtime.gc_freeze import freeze_start_up
from runtime.internal_auth import SecretError, load_secret
from runtime.log_setup import configure_logging
from runtime.tls import LOOPBACK, TlsError

EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split("\n")[0])
    return config_flags.parse(GatewayConfig, parser, argv, ConfigError)


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
    log.info("draining", grace_period_s=config.grace_period)
    await gateway.stop(config.grace_period)
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

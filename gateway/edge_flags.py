"""The gateway's connection and stream limits (and its on/off switches) as
command-line flags, in one place.

``python -m gateway`` and ``continuum serve`` both take them (serve passes the ones
it was given on to its gateway), so a limit is named, defaulted and documented once:
the defaults and the servers they follow are in gateway/config.py. This module
imports nothing heavy, so the CLI can use it without loading the gateway.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

from gateway.config import GatewayConfig

# (flag, GatewayConfig field, type, help)
FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--http-header-timeout", "http_header_timeout_s", float,
     "seconds a request head may take to arrive once begun"),
    ("--http-keepalive-timeout", "http_keepalive_timeout_s", float,
     "seconds an idle keep-alive HTTP connection stays open"),
    ("--http-body-timeout", "http_body_timeout_s", float,
     "seconds a request body may take to arrive (408 after that)"),
    ("--http-max-connections", "http_max_connections", int,
     "open HTTP connections at most (one more gets 503)"),
    ("--grpc-max-concurrent-streams", "grpc_max_concurrent_streams", int,
     "concurrent gRPC streams per connection"),
    ("--grpc-max-connection-idle", "grpc_max_connection_idle_s", float,
     "seconds before an idle gRPC connection is closed (0: never)"),
    ("--stream-progress-timeout", "stream_progress_timeout_s", float,
     "seconds a stream may hear nothing from its scheduler replica before the replica "
     "is probed (two missed probes: the stream continues on another replica; default 5)"),
    ("--slow-reader-timeout", "slow_reader_timeout_s", float,
     "seconds a client may leave one response unread before its request is cancelled "
     "(default 30)"),
    ("--tool-call-parser", "tool_call_parser", str,
     "how tool calls are read from the model's text with tool_choice auto: hermes "
     "(<tool_call> blocks or a bare JSON call; the default) or json / llama3_json"),
)

# (flag, GatewayConfig field, help): off unless given.
SWITCHES: tuple[tuple[str, str, str], ...] = (
    ("--allow-special-tokens-in-content", "allow_special_tokens_in_content",
     "let special-token strings in chat messages and tools (e.g. <|im_start|>) be the "
     "control tokens themselves instead of text: for deployments that trust every "
     "client with roles (docs/security.md)"),
)


def _defaults() -> GatewayConfig:
    return GatewayConfig(model_dir=pathlib.Path("."), scheduler_address="127.0.0.1:1")


def add_flags(parser: argparse.ArgumentParser, pass_through: bool = False) -> None:
    """Adds every flag; ``pass_through`` (serve): no default, so only flags the user
    gave are passed on and the gateway keeps its own defaults for the rest."""
    defaults = _defaults()
    for flag, field, kind, text in FLAGS:
        default = getattr(defaults, field)
        shown = "" if default is None else f" (default {default:g})"
        parser.add_argument(flag, type=kind, default=None if pass_through else default,
                            dest=field, help=text + shown)
    for flag, field, text in SWITCHES:
        parser.add_argument(flag, action="store_true", dest=field,
                            default=None if pass_through else False, help=text)


def config_fields(args: argparse.Namespace) -> dict:
    """GatewayConfig keyword arguments from parsed flags."""
    return ({field: getattr(args, field) for _, field, _, _ in FLAGS}
            | {field: bool(getattr(args, field)) for _, field, _ in SWITCHES})


def to_argv(args: argparse.Namespace) -> list[str]:
    """The flags the user gave, as gateway command-line arguments."""
    argv: list[str] = []
    for flag, field, _, _ in FLAGS:
        value = getattr(args, field, None)
        if value is not None:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    argv += [flag for flag, field, _ in SWITCHES if getattr(args, field, None)]
    return argv


assert {f for _, f, _, _ in FLAGS} | {f for _, f, _ in SWITCHES} <= {
    f.name for f in dataclasses.fields(GatewayConfig)}

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
    ("--http-max-connections-per-client", "http_max_connections_per_client", int,
     "open HTTP connections per client address (one more gets 429)"),
    ("--max-streams-per-client", "max_streams_per_client", int,
     "generation requests in flight per client address, HTTP and gRPC together "
     "(one more gets 429 / RESOURCE_EXHAUSTED)"),
    ("--trusted-proxies", "trusted_proxies", str,
     "comma-separated IPs / CIDRs of proxies whose X-Forwarded-For names the client "
     "(default: none; the header is ignored)"),
    ("--probe-port", "probe_port", int,
     "serve /live and /health alone on this port, for the kubelet's probes (default: "
     "none; they are routes of the HTTP port too)"),
    ("--grpc-max-concurrent-streams", "grpc_max_concurrent_streams", int,
     "concurrent gRPC streams per connection"),
    ("--grpc-max-concurrent-rpcs", "grpc_max_concurrent_rpcs", int,
     "concurrent gRPC calls on the gateway, all connections together, health aside "
     "(one more gets RESOURCE_EXHAUSTED with a retry pushback)"),
    ("--grpc-max-connection-idle", "grpc_max_connection_idle_s", float,
     "seconds before an idle gRPC connection is closed (0: never)"),
    ("--stream-progress-timeout", "stream_progress_timeout_s", float,
     "seconds a stream may hear nothing from its scheduler replica before the replica "
     "is probed (two missed probes: the stream continues on another replica; default 5)"),
    ("--slow-reader-timeout", "slow_reader_timeout_s", float,
     "seconds a client may leave one response unread before its request is cancelled "
     "(default 30)"),
    ("--upstream-call-max-age", "upstream_call_max_age_s", float,
     "seconds the gateway's one call to a scheduler replica takes new requests before a "
     "new call replaces it (for a proxy between them that cuts long calls; default 0: "
     "never; docs/grpc.md)"),
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

# (flag and its aliases, GatewayConfig field, help): PEM files; TLS is off unless given.
# The aliases are vLLM's names for the same three files.
TLS_FLAGS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("--tls-cert-file", "--ssl-certfile"), "tls_cert_file",
     "serve TLS on the gRPC and HTTP ports with this certificate chain (PEM; re-read "
     "when it changes; default: plaintext)"),
    (("--tls-key-file", "--ssl-keyfile"), "tls_key_file", "the certificate's private key"),
    (("--tls-client-ca-file", "--ssl-ca-certs"), "tls_client_ca_file",
     "mutual TLS: every client, on both ports, must present a certificate signed by "
     "a CA in this file"),
    (("--scheduler-tls-ca-file",), "scheduler_tls_ca_file",
     "connect to the scheduler replicas over TLS, checking their certificates "
     "against this CA (default: plaintext)"),
    (("--scheduler-tls-server-name",), "scheduler_tls_server_name",
     "the name the scheduler certificates must carry (default: each address's host; "
     "name the Service for a dns:/// set)"),
    (("--scheduler-tls-client-cert-file",), "scheduler_tls_client_cert_file",
     "the gateway's certificate for a scheduler that requires one (mutual TLS)"),
    (("--scheduler-tls-client-key-file",), "scheduler_tls_client_key_file",
     "that certificate's private key"),
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
    for flags, field, text in TLS_FLAGS:
        kind = str if field == "scheduler_tls_server_name" else pathlib.Path
        parser.add_argument(*flags, type=kind, default=None, dest=field, help=text)


def config_fields(args: argparse.Namespace) -> dict:
    """GatewayConfig keyword arguments from parsed flags."""
    return ({field: getattr(args, field) for _, field, _, _ in FLAGS}
            | {field: bool(getattr(args, field)) for _, field, _ in SWITCHES}
            | {field: getattr(args, field) for _, field, _ in TLS_FLAGS})


def to_argv(args: argparse.Namespace) -> list[str]:
    """The flags the user gave, as gateway command-line arguments."""
    argv: list[str] = []
    for flag, field, _, _ in FLAGS:
        value = getattr(args, field, None)
        if value is not None:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    argv += [flag for flag, field, _ in SWITCHES if getattr(args, field, None)]
    for (flag, *_), field, _ in TLS_FLAGS:
        value = getattr(args, field, None)
        if value is not None:  # a file is named from serve's directory, not the child's
            argv += [flag, value if isinstance(value, str) else str(value.absolute())]
    return argv


assert {f for _, f, _, _ in FLAGS} | {f for _, f, _ in (*SWITCHES, *TLS_FLAGS)} <= {
    f.name for f in dataclasses.fields(GatewayConfig)}

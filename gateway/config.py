"""The gateway's one frozen config, built by `__main__` and validated once."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from gateway.admit.routing_headers import DEFAULT_OBJECTIVE_TIERS
from protos import tiers
from runtime.config_flags import check_bounds, knob
from runtime.tls import ServerTls, TlsError, server_tls


class ConfigError(ValueError):
    """A setting that cannot work; the message says which flag to change."""


# The default body limit pays for the longest prompt the context holds: 32 bytes a token
# covers English, CJK in UTF-8 and JSON's \u escapes with room (other fields are capped
# far below: protos/limits.py). At least 1 MiB, nginx's `client_max_body_size`. Body bytes
# cost GIL time every stream waits on (docs/reliability.md, "Hostile row after the body
# limit follows the context").
BODY_BYTES_PER_TOKEN = 32
MIN_DEFAULT_BODY_BYTES = 1 << 20


def default_body_limit(max_model_len: int) -> int:
    """The `--max-body-bytes` default for a context of `max_model_len` tokens: a whole
    number of MiB, at least 1."""
    mib = 1 << 20
    return max(MIN_DEFAULT_BODY_BYTES, -(-max_model_len * BODY_BYTES_PER_TOKEN // mib) * mib)


TLS_HELP = ("serve TLS on the gRPC and HTTP ports with this certificate chain (PEM; "
            "re-read when it changes: runtime/tls.py; default: plaintext)")


@dataclass(frozen=True)
class GatewayConfig:
    """Every field is a flag of ``python -m gateway`` and of ``continuum serve``
    (runtime/config_flags.py). The connection limits follow nginx's client_header_timeout
    and client_body_timeout (60 s), tightened for an API whose requests are small;
    gateway/edge/client_limits.py says why the per-client numbers are what they are."""

    model_dir: pathlib.Path = knob(help="Hugging Face-format model directory "
                                   "(tokenizer.json, config.json)", serve=False)
    scheduler_address: str = knob(
        help="scheduler replica(s), HOST:PORT[,HOST:PORT...]; each request goes to the "
            "least-loaded healthy one and moves on if that one fails. dns:///NAME:PORT: every "
            "address NAME resolves to, re-resolved every 5 s (a Kubernetes headless Service)",
        flag="--scheduler", serve=False)
    host: str = knob("127.0.0.1", "address the gRPC and HTTP ports listen on")
    port: int = knob(50051, "client gRPC port (0: any; the bound port is logged)")
    model_name: str = knob("", "model name clients may send (default: the model dir's name)",
                           serve=False)
    max_model_len: int | None = knob(None, "context limit (default: config.json's "
                                           "max_position_embeddings)")
    grace_period: float = knob(30.0, "on SIGTERM, seconds in-flight requests may finish in "
                                     "(under serve a second Ctrl-C stops at once)", lo=0)
    http_port: int = knob(8000, "OpenAI-compatible HTTP API port (0: any free port; -1: no "
                                "HTTP server)", lo=-1, hi=65535)
    max_body_bytes: int | None = knob(None, "largest HTTP body / gRPC message, 413 / "
                                            "RESOURCE_EXHAUSTED above it (default: 32 B a "
                                            "context token, >= 1 MiB)", lo=1024)
    api_keys_file: pathlib.Path | None = knob(
        None, "require API keys: one KEY, KEY:TENANT, KEY:TENANT:TIERS or "
              "KEY:TENANT:TIERS:GRANTS per line (TIERS e.g. premium+standard+best_effort; "
              "GRANTS: special_tokens; also env CONTINUUM_API_KEYS; gateway/admit/auth.py)")
    http_header_timeout_s: float = knob(10.0, "seconds a request head may take to arrive "
                                              "once begun", flag="--http-header-timeout",
                                        above=0)
    # 75 s, nginx's keepalive_timeout: past common proxies' 60 s idle timeout, so a proxy
    # never reuses a connection we are closing.
    http_keepalive_timeout_s: float = knob(75.0, "seconds an idle keep-alive HTTP connection "
                                                 "stays open (longer than common proxies' "
                                                 "60 s)", flag="--http-keepalive-timeout",
                                           above=0)
    http_body_timeout_s: float = knob(30.0, "seconds a request body may take to arrive (408 "
                                            "after that)", flag="--http-body-timeout",
                                      above=0)
    # After answering a request whose body was not read in full (408, 413), how long the
    # rest is still read before the connection is closed; not a flag.
    http_lingering_s: float = 5.0
    http_max_connections: int = knob(2048, "open HTTP connections at most (one more gets "
                                           "503; nginx's worker_connections is 512 a "
                                           "worker)", lo=1)
    http_max_connections_per_client: int = knob(256, "open HTTP connections per client "
                                                     "address (one more gets 429)", lo=1)
    max_streams_per_client: int = knob(512, "generation requests in flight per client "
                                            "address, HTTP and gRPC together (one more gets "
                                            "429 / RESOURCE_EXHAUSTED)", lo=1)
    trusted_proxies: str | None = knob(None, "comma-separated IPs / CIDRs of proxies whose "
                                             "X-Forwarded-For names the client (default: "
                                             "none; the header is ignored)")
    probe_port: int | None = knob(None, "serve /live and /health alone on this port, for the "
                                        "kubelet's probes (default: none; they are routes "
                                        "of the HTTP port too)", lo=0, hi=65535)
    grpc_max_concurrent_streams: int = knob(100, "concurrent gRPC streams per connection "
                                                 "(RFC 9113's recommended floor)", lo=1)
    grpc_max_connection_idle_s: float = knob(300.0, "seconds before an idle gRPC connection "
                                                    "is closed with GOAWAY (0: never)",
                                             flag="--grpc-max-connection-idle", lo=0)
    # The process-wide bound beside the per-connection one, as nginx has worker_connections
    # beside http2_max_concurrent_streams: twice http_max_connections, eight clients at
    # max_streams_per_client, room for three replicas' admitted work (64 running + 1,024
    # waiting each by default; raise it for a gateway before more).
    grpc_max_concurrent_rpcs: int = knob(4096, "concurrent gRPC calls on the gateway, all "
                                               "connections together, health aside (one more "
                                               "gets RESOURCE_EXHAUSTED with a retry "
                                               "pushback)", lo=1)
    stream_progress_timeout_s: float | None = knob(
        None, "seconds a stream may hear nothing from its scheduler replica before the "
              "replica is probed (two missed probes: the stream continues on another "
              "replica; default: gateway/routing/watchdog.py's 5)",
        flag="--stream-progress-timeout", above=0)
    slow_reader_timeout_s: float | None = knob(
        None, "seconds a client may leave one response unread (a full flow-control window "
              "or SSE send buffer) before its request is cancelled (default: the "
              "watchdog's 30)", flag="--slow-reader-timeout", above=0)
    objective_tiers: tuple[str, ...] = knob(
        (), "an inference gateway objective (x-llm-d-inference-objective header) that maps "
            f"to a tier, NAME=TIER, beside {'/'.join((*tiers.NAMES, *DEFAULT_OBJECTIVE_TIERS))}"
            "; repeatable", flag="--objective-tier", metavar="NAME=TIER")
    tool_call_parser: str | None = knob(None, "how tool calls are read from the model's text "
                                              "with tool_choice auto: hermes (<tool_call> "
                                              "blocks or a bare JSON call; the default) or "
                                              "json / llama3_json")
    allow_special_tokens_in_content: bool = knob(
        False, "let special-token strings in chat messages and tools (e.g. <|im_start|>) be "
               "the control tokens themselves instead of text: for deployments that trust "
               "every client with roles (docs/security.md)")
    upstream_call_max_age_s: float = knob(
        0.0, "seconds the gateway's one SubmitMany call to a scheduler replica takes new "
             "requests before a new call replaces it, for a proxy between them that cuts long "
             "calls (0: never; docs/grpc.md)", flag="--upstream-call-max-age", lo=0)
    tls_cert_file: pathlib.Path | None = knob(None, TLS_HELP, aliases=("--ssl-certfile",))
    tls_key_file: pathlib.Path | None = knob(None, "the certificate's private key",
                                             aliases=("--ssl-keyfile",))
    tls_client_ca_file: pathlib.Path | None = knob(
        None, "mutual TLS: every client, on both ports, must present a certificate signed by "
              "a CA in this file", aliases=("--ssl-ca-certs",))
    scheduler_tls_ca_file: pathlib.Path | None = knob(
        None, "connect to the scheduler replicas over TLS, checking their certificates "
              "against this CA (default: plaintext)")
    scheduler_tls_server_name: str | None = knob(
        None, "the name the scheduler certificates must carry (default: each address's host; "
              "name the Service for a dns:/// set, which resolves to pod IPs)")
    scheduler_tls_client_cert_file: pathlib.Path | None = knob(
        None, "the gateway's certificate for a scheduler that requires one (mutual TLS)")
    scheduler_tls_client_key_file: pathlib.Path | None = knob(None, "that certificate's "
                                                                    "private key")

    @property
    def server_tls(self) -> ServerTls | None:
        """The client-facing ports' TLS (None: plaintext); raises TlsError."""
        return server_tls(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    def _check_tls(self) -> None:
        try:
            self.server_tls  # noqa: B018 -- the flags' pairing, checked once
        except TlsError as exc:
            raise ConfigError(str(exc)) from exc
        client = (self.scheduler_tls_client_cert_file, self.scheduler_tls_client_key_file)
        if (client[0] is None) != (client[1] is None):
            raise ConfigError("--scheduler-tls-client-cert-file and "
                              "--scheduler-tls-client-key-file go together")
        if self.scheduler_tls_ca_file is None and (
                client[0] is not None or self.scheduler_tls_server_name is not None):
            raise ConfigError("--scheduler-tls-client-cert-file and --scheduler-tls-server-"
                              "name need --scheduler-tls-ca-file (TLS to the scheduler)")

    def _check_client_limits(self) -> None:
        from gateway.edge.client_limits import parse_networks  # the stdlib only, and grpc
        try:
            parse_networks(self.trusted_proxies)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if self.probe_port and self.probe_port in (self.port, self.http_port):
            raise ConfigError(f"--probe-port {self.probe_port} is also --port or "
                              "--http-port; pick its own port")

    def body_limit(self, max_model_len: int) -> int:
        """The body limit in force: `--max-body-bytes`, or the context's default."""
        return self.max_body_bytes or default_body_limit(max_model_len)

    @property
    def scheduler_addresses(self) -> list[str]:
        return [a.strip() for a in self.scheduler_address.split(",") if a.strip()]

    def __post_init__(self) -> None:
        if not self.model_name:
            object.__setattr__(self, "model_name", self.model_dir.resolve().name)
        check_bounds(self, ConfigError)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port} is not a TCP port (0..65535)")
        for address in self.scheduler_addresses:
            host, sep, port = address.removeprefix("dns:///").rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ConfigError(
                    f"--scheduler {address!r} is not HOST:PORT or dns:///NAME:PORT "
                    "(e.g. 127.0.0.1:50061, dns:///continuum-replica:50061)"
                )
        if self.http_port > 0 and self.http_port == self.port:
            raise ConfigError(f"--http-port and --port are both {self.port}; pick two ports")
        self._check_client_limits()
        for entry in self.objective_tiers:
            name, sep, tier = entry.partition("=")
            if not sep or not name.strip() or tiers.parse(tier) is None:
                raise ConfigError(f"--objective-tier {entry!r} must be NAME=TIER with TIER "
                                  f"one of {', '.join(tiers.NAMES)}")
        if self.tool_call_parser is not None:
            from gateway.tools.tool_parsers import PARSERS  # pure Python, imports nothing heavy
            if self.tool_call_parser not in PARSERS:
                raise ConfigError(f"--tool-call-parser {self.tool_call_parser!r} is not one "
                                  f"of {', '.join(sorted(PARSERS))}")
        self._check_tls()

"""The gateway's one frozen config, built by `__main__` and validated once."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from protos import tiers
from runtime.tls import ServerTls, TlsError, server_tls


class ConfigError(ValueError):
    """A setting that cannot work; the message says which flag to change."""


# The default body limit pays for the longest prompt the context holds: 32 bytes a
# token covers English (~4 bytes a token), CJK in UTF-8 (~3 bytes a character) and
# JSON's \u escapes (6 bytes a character) with room; every other field is capped
# far below (tools 48 KiB, a guided spec 64 KiB: protos/limits.py). Never below
# 1 MiB, nginx's default `client_max_body_size` (TGI's `--payload-limit` is 2 MB):
# 1 MiB for an 8k context, 4 MiB for 128k. Each byte of a body costs the gateway
# CPU under the GIL that every other stream's tokens wait on: at 20 bodies a second
# near 4 MiB a normal stream's ITL p99 rose 4.2x over small twins on 2 cores, near
# 1 MiB 1.16-1.33x (docs/reliability.md).
BODY_BYTES_PER_TOKEN = 32
MIN_DEFAULT_BODY_BYTES = 1 << 20


def default_body_limit(max_model_len: int) -> int:
    """The `--max-body-bytes` default for a context of `max_model_len` tokens: a whole
    number of MiB, at least 1."""
    mib = 1 << 20
    return max(MIN_DEFAULT_BODY_BYTES, -(-max_model_len * BODY_BYTES_PER_TOKEN // mib) * mib)


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: pathlib.Path
    # HOST:PORT of the scheduler replica(s), comma-separated; each request goes
    # to the least-loaded healthy one and moves on if that one fails. dns:///NAME:PORT
    # is every address NAME resolves to, re-resolved (a headless Service; replicas.py).
    scheduler_address: str
    host: str = "127.0.0.1"
    # 0 picks a free port (tests); the bound port is logged.
    port: int = 50051
    # Name clients may put in GenerateRequest.model; defaults to the model dir's name.
    model_name: str = ""
    # Overrides config.json's max_position_embeddings when set.
    max_model_len: int | None = None
    # How long in-flight calls may continue after SIGTERM before they are cut.
    grace_period_s: float = 5.0
    # The OpenAI-compatible HTTP API's port; None: no HTTP server, 0: any free port.
    http_port: int | None = None
    # Largest HTTP body / gRPC message accepted (413 / RESOURCE_EXHAUSTED above it);
    # None: derived from the context length (`default_body_limit`).
    max_body_bytes: int | None = None
    # File of API keys (KEY[:TENANT[:TIERS[:GRANTS]]] per line); see gateway/admit/auth.py.
    api_keys_file: pathlib.Path | None = None
    # Connections cannot be held hostage (defaults after nginx's client_header_timeout
    # and client_body_timeout, 60 s, tightened for an API whose requests are small):
    # seconds a request head may take to arrive in full once it has begun, before
    # the connection is closed;
    http_header_timeout_s: float = 10.0
    # seconds an idle keep-alive connection stays open (nginx's keepalive_timeout;
    # longer than the 60 s idle timeout of common proxies in front of us);
    http_keepalive_timeout_s: float = 75.0
    # seconds a request body may take to arrive in full (408 after that);
    http_body_timeout_s: float = 30.0
    # after answering a request whose body was not read in full (408, 413), how
    # long the rest is still read before the connection is closed;
    http_lingering_s: float = 5.0
    # open HTTP connections at most; one more is answered 503 and closed
    # (nginx's worker_connections default is 512 per worker; 2,048 per gateway);
    http_max_connections: int = 2048
    # Per client address (gateway/edge/client_limits.py says why these numbers): open HTTP
    # connections (one more gets 429), and generation streams in flight on both APIs
    # together (429 / RESOURCE_EXHAUSTED);
    http_max_connections_per_client: int = 256
    max_streams_per_client: int = 512
    # comma-separated IPs / CIDRs of proxies whose X-Forwarded-For names the client
    # (their own connections are not capped per address); None: the header is ignored;
    trusted_proxies: str | None = None
    # a listener serving only /live and /health, for the kubelet (gateway/edge/probes.py);
    # None: no such listener (the probes are still routes of the HTTP port).
    probe_port: int | None = None
    # concurrent gRPC streams per HTTP/2 connection: 100, the floor RFC 9113 §5.1.2
    # recommends (nginx's http2_max_concurrent_streams is 128);
    grpc_max_concurrent_streams: int = 100
    # a gRPC connection with no call for this long is closed (GOAWAY), like
    # grpc-go's MaxConnectionIdle; 0 disables.
    grpc_max_connection_idle_s: float = 300.0
    # gRPC calls in flight at once on this gateway, over all connections, health checks
    # aside (gateway/rpc/rpc_limit.py); one more is RESOURCE_EXHAUSTED with a retry hint.
    # The process-wide bound beside the per-connection one, as nginx has
    # worker_connections beside http2_max_concurrent_streams and Envoy its overload
    # manager's global_downstream_max_connections: twice http_max_connections, eight
    # clients at max_streams_per_client, room for three replicas' admitted work (64
    # running + 1,024 waiting each by default; raise it for a gateway before more).
    grpc_max_concurrent_rpcs: int = 4096
    # A stream silent this long has its replica probed; two missed probes and it
    # continues elsewhere (a replica that answers is only slow). None: the watchdog's
    # default, gateway/routing/watchdog.py's PROGRESS_TIMEOUT_S (5 s).
    stream_progress_timeout_s: float | None = None
    # A client that leaves one response unread this long has its request cancelled
    # (gRPC's flow-control window, or SSE's 64 KiB send buffer, is full). None: the
    # watchdog's WRITE_STALL_S (30 s).
    slow_reader_timeout_s: float | None = None
    # NAME=TIER entries: an inference gateway's objective names that map to our tiers,
    # beside the defaults (gateway/admit/routing_headers.py).
    objective_tiers: tuple[str, ...] = ()
    # How "auto" tool_choice reads calls out of the model's text (gateway/tools/tool_parsers.py).
    # None: hermes.
    tool_call_parser: str | None = None
    # Special-token strings in chat content, tool results, call arguments and tool
    # definitions become the control tokens themselves, as before escaping existed:
    # only for deployments whose every client may write roles (docs/security.md).
    allow_special_tokens_in_content: bool = False
    # Requests to a replica share one SubmitMany call to it (gateway/routing/mux.py); a
    # call this old takes no new request and closes once its streams end, for a proxy
    # between gateway and scheduler that cuts long calls. 0: a call lives while it works.
    upstream_call_max_age_s: float = 0.0
    # TLS on the gRPC and HTTP ports (one certificate serves both; PEM files, re-read
    # when they change: runtime/tls.py); None: plaintext. A client CA makes it mutual:
    # every client, on both ports, must present a certificate signed by it.
    tls_cert_file: pathlib.Path | None = None
    tls_key_file: pathlib.Path | None = None
    tls_client_ca_file: pathlib.Path | None = None
    # TLS to the scheduler replicas: the CA their certificates are checked against
    # (None: plaintext), the name checked in them (None: each address's host; a
    # dns:/// set resolves to pod IPs, so name the Service), and the gateway's own
    # certificate and key for a scheduler that requires one.
    scheduler_tls_ca_file: pathlib.Path | None = None
    scheduler_tls_server_name: str | None = None
    scheduler_tls_client_cert_file: pathlib.Path | None = None
    scheduler_tls_client_key_file: pathlib.Path | None = None

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
        for flag, value in (("--http-max-connections-per-client",
                             self.http_max_connections_per_client),
                            ("--max-streams-per-client", self.max_streams_per_client)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        from gateway.edge.client_limits import parse_networks  # the stdlib only, and grpc
        try:
            parse_networks(self.trusted_proxies)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if self.probe_port is not None:
            if not 0 <= self.probe_port <= 65535:
                raise ConfigError(f"--probe-port {self.probe_port} is not a TCP port")
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
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port} is not a TCP port (0..65535)")
        for address in self.scheduler_addresses:
            host, sep, port = address.removeprefix("dns:///").rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ConfigError(
                    f"--scheduler {address!r} is not HOST:PORT or dns:///NAME:PORT "
                    "(e.g. 127.0.0.1:50061, dns:///continuum-replica:50061)"
                )
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ConfigError(f"--http-port {self.http_port} is not a TCP port (0..65535)")
        if self.http_port and self.http_port == self.port:
            raise ConfigError(f"--http-port and --port are both {self.port}; pick two ports")
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"--max-model-len must be > 0, got {self.max_model_len}")
        if self.grace_period_s < 0:
            raise ConfigError(f"--grace-period must be >= 0, got {self.grace_period_s}")
        for flag, value in (("--http-header-timeout", self.http_header_timeout_s),
                            ("--http-body-timeout", self.http_body_timeout_s),
                            ("--http-keepalive-timeout", self.http_keepalive_timeout_s)):
            if not value > 0:
                raise ConfigError(f"{flag} must be > 0 seconds, got {value}")
        if self.http_max_connections < 1:
            raise ConfigError(
                f"--http-max-connections must be >= 1, got {self.http_max_connections}")
        self._check_client_limits()
        if self.grpc_max_concurrent_streams < 1:
            raise ConfigError("--grpc-max-concurrent-streams must be >= 1, got "
                              f"{self.grpc_max_concurrent_streams}")
        if self.grpc_max_concurrent_rpcs < 1:
            raise ConfigError("--grpc-max-concurrent-rpcs must be >= 1, got "
                              f"{self.grpc_max_concurrent_rpcs}")
        for flag, value in (("--stream-progress-timeout", self.stream_progress_timeout_s),
                            ("--slow-reader-timeout", self.slow_reader_timeout_s)):
            if value is not None and not value > 0:
                raise ConfigError(f"{flag} must be > 0 seconds, got {value}")
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
        if self.grpc_max_connection_idle_s < 0:
            raise ConfigError("--grpc-max-connection-idle must be >= 0, got "
                              f"{self.grpc_max_connection_idle_s}")
        self._check_tls()

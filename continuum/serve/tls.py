"""``continuum serve``'s TLS: the check that the scheduler's side (its
``--scheduler-tls-cert-file``, ``-key-file``, ``-client-ca-file``) fits the gateway's
(``--scheduler-tls-ca-file`` it checks that certificate with, and under mutual TLS
``--scheduler-tls-client-cert-file`` and ``-key-file`` it answers with), and the
supervisor's own connections to a scheduler and a gateway that speak TLS.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable, Iterator

import grpc

from gateway.config import GatewayConfig
from runtime import tls
from scheduler_svc.process_config import SchedulerProcessConfig


def problem(scheduler_side: SchedulerProcessConfig, gateway: GatewayConfig) -> str | None:
    """What does not fit between the scheduler's TLS and the gateway's TLS to it, as a
    message naming the flags (None: fine)."""
    s = scheduler_side
    try:
        scheduler = tls.server_tls(s.scheduler_tls_cert_file, s.scheduler_tls_key_file,
                                   s.scheduler_tls_client_ca_file, prefix="--scheduler-tls")
    except tls.TlsError as exc:
        return str(exc)
    if (scheduler is None) != (gateway.scheduler_tls_ca_file is None):
        return ("--scheduler-tls-cert-file and --scheduler-tls-ca-file go together: the "
                "scheduler serves TLS, the gateway checks it against the CA")
    if scheduler is not None and scheduler.client_ca_file is not None and \
            gateway.scheduler_tls_client_cert_file is None:
        return ("--scheduler-tls-client-ca-file needs --scheduler-tls-client-cert-file and "
                "--scheduler-tls-client-key-file: the certificate the gateway presents")
    return None


def scheduler_channel(gateway: GatewayConfig, address: str) -> grpc.Channel:
    """The supervisor's channel to its scheduler, as secure as the gateway's."""
    if gateway.scheduler_tls_ca_file is None:
        return grpc.insecure_channel(address)
    credentials = tls.channel_credentials(gateway.scheduler_tls_ca_file,
                                          gateway.scheduler_tls_client_cert_file,
                                          gateway.scheduler_tls_client_key_file)
    name = gateway.scheduler_tls_server_name
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(address, credentials, options=options)


def answers_tls(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TLS server answers a handshake on (host, port): a readiness probe that
    sends nothing and trusts nothing (the certificate is not checked, and under mutual
    TLS the refusal of our certificate-less hello comes after the server has spoken)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw) as tls_socket:
            return tls_socket.version() is not None
    except (OSError, ssl.SSLError):
        return False


@contextlib.contextmanager
def gateway_probe(gateway: GatewayConfig) -> Iterator[Callable[[float], bool]]:
    """``ready(timeout_s)``: whether the gateway's gRPC port answers. Over TLS a handshake
    is the probe (serve holds no certificate the gateway's clients are checked with)."""
    host, port = gateway.host, gateway.port
    if gateway.tls_cert_file is not None:
        def handshake(timeout_s: float) -> bool:
            if answers_tls(host, port, timeout_s):
                return True
            time.sleep(min(timeout_s, 0.2))  # refused at once while nothing listens
            return False

        yield handshake
        return
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        ready = grpc.channel_ready_future(channel)

        def probe(timeout_s: float) -> bool:
            try:
                ready.result(timeout=timeout_s)
                return True
            except grpc.FutureTimeoutError:
                return False

        yield probe

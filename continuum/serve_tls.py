"""``continuum serve``'s TLS: the scheduler port's flags, the check that the pieces fit,
and the supervisor's own connections to a scheduler and a gateway that speak TLS.

The gateway's flags (``--tls-*`` for its ports, ``--scheduler-tls-*`` for its channels
to the scheduler) are gateway/edge/edge_flags.py's and pass straight through; this module
adds the scheduler's side (``--scheduler-tls-cert-file``, ``-key-file``,
``-client-ca-file``), whose certificate the gateway and the supervisor check against
``--scheduler-tls-ca-file`` and, under mutual TLS, answer with
``--scheduler-tls-client-cert-file`` and ``-key-file``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterator

import grpc

from runtime import tls

# serve's flag -> the scheduler's.
SCHEDULER_FLAGS = (("scheduler_tls_cert_file", "--tls-cert-file"),
                   ("scheduler_tls_key_file", "--tls-key-file"),
                   ("scheduler_tls_client_ca_file", "--tls-client-ca-file"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS on the internal scheduler port (passed to the scheduler)")
    g.add_argument("--scheduler-tls-cert-file", default=None,
                   help="serve the scheduler port over TLS with this certificate chain "
                        "(needs --scheduler-tls-ca-file, which the gateway checks it with)")
    g.add_argument("--scheduler-tls-key-file", default=None,
                   help="the scheduler certificate's private key")
    g.add_argument("--scheduler-tls-client-ca-file", default=None,
                   help="mutual TLS: the scheduler requires a client certificate signed by "
                        "this CA (the gateway's: --scheduler-tls-client-cert-file)")


def problem(args: argparse.Namespace) -> str | None:
    """What does not fit among the TLS flags, as a message naming them (None: fine)."""
    try:
        scheduler = tls.server_tls(args.scheduler_tls_cert_file, args.scheduler_tls_key_file,
                                   args.scheduler_tls_client_ca_file, prefix="--scheduler-tls")
    except tls.TlsError as exc:
        return str(exc)
    if (scheduler is None) != (args.scheduler_tls_ca_file is None):
        return ("--scheduler-tls-cert-file and --scheduler-tls-ca-file go together: the "
                "scheduler serves TLS, the gateway checks it against the CA")
    if scheduler is not None and scheduler.client_ca_file is not None and \
            args.scheduler_tls_client_cert_file is None:
        return ("--scheduler-tls-client-ca-file needs --scheduler-tls-client-cert-file and "
                "--scheduler-tls-client-key-file: the certificate the gateway presents")
    return None


def scheduler_argv(args: argparse.Namespace) -> list[str]:
    """The scheduler's TLS flags, files named from serve's directory."""
    argv = []
    for field, flag in SCHEDULER_FLAGS:
        if getattr(args, field, None):
            argv += [flag, os.path.abspath(getattr(args, field))]
    return argv


def scheduler_channel(args: argparse.Namespace, address: str) -> grpc.Channel:
    """The supervisor's channel to its scheduler, as secure as the gateway's."""
    if getattr(args, "scheduler_tls_ca_file", None) is None:
        return grpc.insecure_channel(address)
    credentials = tls.channel_credentials(args.scheduler_tls_ca_file,
                                          args.scheduler_tls_client_cert_file,
                                          args.scheduler_tls_client_key_file)
    name = args.scheduler_tls_server_name
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
def gateway_probe(args: argparse.Namespace) -> Iterator[Callable[[float], bool]]:
    """``ready(timeout_s)``: whether the gateway's gRPC port answers. Over TLS a handshake
    is the probe (serve holds no certificate the gateway's clients are checked with)."""
    host, port = args.host, args.port
    if getattr(args, "tls_cert_file", None) is not None:
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

"""TLS on every port: certificate files read, checked and reloaded, for grpc and ssl.

Shared by both services and the CLI. A missing, unreadable or unparsable file, or a key
that does not match its certificate, is a one-line startup error (``TlsError``). A
server's files are stat'ed again as each connection arrives; a changed pair is checked,
then used for that and later connections (open ones keep theirs). A half-replaced pair
fails the check and the previous one stays, so rotating a mounted Kubernetes Secret (a
symlink flip) rotates the certificate without a restart.
"""

from __future__ import annotations

import logging
import os
import pathlib
import ssl
from dataclasses import dataclass

import grpc

_log = logging.getLogger("continuum.tls")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file."""


def _read(path: pathlib.Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read the {what} {path}: {exc.strerror}") from exc


def _check_pair(cert: pathlib.Path, key: pathlib.Path) -> ssl.SSLContext:
    """A scratch server context holding the pair; TlsError when they do not go together."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise TlsError(f"the TLS certificate {cert} and key {key} cannot be used together "
                       f"(not PEM, or the key is not the certificate's): {exc.reason}") from exc
    except OSError as exc:
        raise TlsError(f"cannot read the TLS certificate {cert} or key {key}: "
                       f"{exc.strerror}") from exc
    return context


def _check_ca(ca: pathlib.Path, context: ssl.SSLContext | None = None) -> bytes:
    pem = _read(ca, "CA file")
    try:
        (context or ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)).load_verify_locations(ca)
    except ssl.SSLError as exc:
        raise TlsError(f"the CA file {ca} holds no usable PEM certificate: {exc.reason}") from exc
    return pem


def _signature(paths: tuple[pathlib.Path | None, ...]) -> tuple:
    """What tells a replaced file: inode (a new file, a flipped symlink), size, mtime."""
    marks = []
    for path in paths:
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        marks.append(None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(marks)


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key, and the CA its clients' certificates must be
    signed by (``client_ca_file`` set: mutual TLS, a client without one is refused)."""

    cert_file: pathlib.Path
    key_file: pathlib.Path
    client_ca_file: pathlib.Path | None = None

    @property
    def files(self) -> tuple[pathlib.Path | None, ...]:
        return self.cert_file, self.key_file, self.client_ca_file

    def load(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, key, client CA) as PEM, checked; raises TlsError."""
        _check_pair(self.cert_file, self.key_file)
        ca = None if self.client_ca_file is None else _check_ca(self.client_ca_file)
        return (_read(self.cert_file, "TLS certificate"), _read(self.key_file, "TLS key"), ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``add_secure_port``, re-read on a connection after a change."""
        return _GrpcReloader(self).credentials()

    def ssl_context(self) -> ReloadingSslContext:
        return ReloadingSslContext(self)


def server_tls(cert: pathlib.Path | str | None, key: pathlib.Path | str | None,
               client_ca: pathlib.Path | str | None = None,
               prefix: str = "--tls") -> ServerTls | None:
    """The ServerTls of three flags (None: plaintext); TlsError names the flag missing."""
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsError(f"{prefix}-client-ca-file needs {prefix}-cert-file and "
                           f"{prefix}-key-file: mutual TLS is TLS first")
        return None
    if cert is None or key is None:
        given, missing = ("cert", "key") if key is None else ("key", "cert")
        raise TlsError(f"{prefix}-{given}-file needs {prefix}-{missing}-file too")
    return ServerTls(pathlib.Path(cert), pathlib.Path(key),
                     None if client_ca is None else pathlib.Path(client_ca))


class _GrpcReloader:
    """grpc's certificate-config fetcher: asked before each handshake, it answers a new
    config when the files changed and the new ones check out, else None (keep)."""

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls
        self._seen = _signature(tls.files)
        self._initial = self._config(tls.load())

    @staticmethod
    def _config(pem: tuple[bytes, bytes, bytes | None]):
        cert, key, ca = pem
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._fetch,
            require_client_authentication=self._tls.client_ca_file is not None)

    def _fetch(self):
        now = _signature(self._tls.files)
        if now == self._seen:
            return None
        self._seen = now
        try:
            config = self._config(self._tls.load())
        except TlsError as exc:  # keep serving the last good pair
            _log.warning("TLS files changed but cannot be used; keeping the old ones: %s", exc)
            return None
        _log.info("TLS certificate reloaded from %s", self._tls.cert_file)
        return config


class ReloadingSslContext:
    """A server ``ssl.SSLContext`` (``.context``) whose certificate is re-read by
    ``refresh()``, which the HTTP server calls as each connection arrives, before its
    handshake. The pair is checked on a scratch context first: a failed load would
    leave the live context without a certificate. A changed client CA file adds its
    CAs (OpenSSL has no removing one from a live context; a restart does that)."""

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls
        tls.load()
        self._seen = _signature(tls.files)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.client_ca_file is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(tls.client_ca_file)

    def refresh(self) -> None:
        now = _signature(self._tls.files)
        if now == self._seen:
            return
        self._seen = now
        try:
            _check_pair(self._tls.cert_file, self._tls.key_file)
            if self._tls.client_ca_file is not None:
                _check_ca(self._tls.client_ca_file)
        except TlsError as exc:
            _log.warning("TLS files changed but cannot be used; keeping the old ones: %s", exc)
            return
        self.context.load_cert_chain(self._tls.cert_file, self._tls.key_file)
        if self._tls.client_ca_file is not None:
            self.context.load_verify_locations(self._tls.client_ca_file)
        _log.info("TLS certificate reloaded from %s", self._tls.cert_file)


def channel_credentials(ca_file: pathlib.Path | str, cert_file: pathlib.Path | str | None = None,
                        key_file: pathlib.Path | str | None = None) -> grpc.ChannelCredentials:
    """A client's credentials: verify the server against ``ca_file``; with a cert and
    key, present them (mutual TLS). Read once; raises TlsError."""
    if (cert_file is None) != (key_file is None):
        raise TlsError("a client certificate needs its key, and a key its certificate")
    ca = _check_ca(pathlib.Path(ca_file))
    if cert_file is None or key_file is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    cert, key = pathlib.Path(cert_file), pathlib.Path(key_file)
    _check_pair(cert, key)
    return grpc.ssl_channel_credentials(root_certificates=ca,
                                        private_key=_read(key, "TLS key"),
                                        certificate_chain=_read(cert, "TLS certificate"))


def add_port(server, address: str, tls: ServerTls | None) -> int:
    """Binds ``address`` on a grpc (or grpc.aio) server, over TLS when ``tls`` is set."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.grpc_credentials())

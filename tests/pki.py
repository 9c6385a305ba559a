"""A throwaway certificate authority for TLS tests (trustme), written to PEM files."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import trustme


@dataclass
class Pki:
    """A CA's file, a server certificate for loopback, and a client certificate."""

    ca: trustme.CA
    ca_file: pathlib.Path
    cert_file: pathlib.Path
    key_file: pathlib.Path
    client_cert_file: pathlib.Path
    client_key_file: pathlib.Path

    @property
    def client(self) -> tuple[pathlib.Path, pathlib.Path]:
        return self.client_cert_file, self.client_key_file


def _write(cert: trustme.LeafCert, cert_file: pathlib.Path, key_file: pathlib.Path) -> None:
    cert.private_key_pem.write_to_path(str(key_file))
    cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))


def make_pki(directory: pathlib.Path, name: str = "pki") -> Pki:
    """A new CA under ``directory/name``; its server certificate names localhost and
    127.0.0.1."""
    directory = directory / name
    directory.mkdir()
    ca = trustme.CA()
    pki = Pki(ca, *(directory / f for f in ("ca.pem", "cert.pem", "key.pem",
                                             "client-cert.pem", "client-key.pem")))
    ca.cert_pem.write_to_path(str(pki.ca_file))
    _write(ca.issue_cert("localhost", "127.0.0.1"), pki.cert_file, pki.key_file)
    _write(ca.issue_cert("client@example.com"), pki.client_cert_file, pki.client_key_file)
    return pki

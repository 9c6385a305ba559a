"""The per-deployment secret that authenticates the internal planes.

The scheduler's gRPC service and the executor channel are deny by default: a caller
without the secret is refused (gRPC UNAUTHENTICATED; a Hello without a valid tag is
dropped). The secret, first match wins: ``CONTINUUM_INTERNAL_SECRET`` (``continuum serve``
hands its children one per run), or ``CONTINUUM_INTERNAL_SECRET_FILE`` (a mounted Secret;
surrounding whitespace ignored); at least ``MIN_SECRET_CHARS`` printable ASCII characters.
With none a service refuses to start, unless ``CONTINUUM_INSECURE_NO_INTERNAL_AUTH=1``.

gRPC callers send it as metadata ``x-continuum-internal-auth``; an executor proves it by
an HMAC-SHA256 tag over its serialized Hello, so the secret never crosses the channel.
All comparisons are constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
import secrets
from collections.abc import Mapping

ENV_SECRET = "CONTINUUM_INTERNAL_SECRET"
ENV_SECRET_FILE = "CONTINUUM_INTERNAL_SECRET_FILE"
ENV_INSECURE = "CONTINUUM_INSECURE_NO_INTERNAL_AUTH"
METADATA_KEY = "x-continuum-internal-auth"
MIN_SECRET_CHARS = 16


class SecretError(ValueError):
    """The configured secret is missing or unusable; the message says how to fix it."""


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _checked(value: str, source: str) -> bytes:
    value = value.strip()
    if len(value) < MIN_SECRET_CHARS:
        raise SecretError(f"{source}: the internal secret must be at least "
                          f"{MIN_SECRET_CHARS} characters (got {len(value)})")
    if not all(" " < c <= "~" for c in value):
        raise SecretError(f"{source}: the internal secret must be printable ASCII "
                          "without spaces")
    return value.encode("ascii")


def load_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The configured secret; None only when the insecure opt-out is set.

    Raises SecretError when none is configured (and no opt-out) or it is unusable."""
    value = environ.get(ENV_SECRET)
    if value:
        return _checked(value, ENV_SECRET)
    path = environ.get(ENV_SECRET_FILE)
    if path:
        try:
            text = pathlib.Path(path).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as exc:
            raise SecretError(f"{ENV_SECRET_FILE}={path}: cannot read it ({exc})") from exc
        return _checked(text, f"{ENV_SECRET_FILE}={path}")
    if environ.get(ENV_INSECURE) == "1":
        return None
    raise SecretError(
        f"no internal secret: set {ENV_SECRET} or {ENV_SECRET_FILE} (continuum serve does "
        f"this itself), or {ENV_INSECURE}=1 to run the internal planes unauthenticated"
    )


def check_token(secret: bytes | None, presented: str | bytes | None) -> bool:
    """True when ``presented`` (gRPC metadata value) is the secret, or auth is off."""
    if secret is None:
        return True
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(hashlib.sha256(presented).digest(),
                               hashlib.sha256(secret).digest())


def metadata(secret: bytes | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a client of an internal service sends."""
    return () if secret is None else ((METADATA_KEY, secret.decode("ascii")),)


def tag(secret: bytes, payload: bytes) -> bytes:
    """HMAC-SHA256 of ``payload`` under ``secret`` (the Hello proof)."""
    return hmac.new(secret, payload, hashlib.sha256).digest()


def check_tag(secret: bytes | None, payload: bytes, presented: bytes) -> bool:
    """True when ``presented`` is ``tag(secret, payload)``, or auth is off."""
    if secret is None:
        return True
    return hmac.compare_digest(tag(secret, payload), presented)

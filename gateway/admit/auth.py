"""Optional API keys, shared by the gRPC and HTTP front ends (docs/usage.md, "API keys").

Entries `KEY[:TENANT[:TIERS[:GRANTS]]]` come from `--api-keys-file` (one a line, `#`
comments) and `CONTINUUM_API_KEYS` (comma-separated). No keys: auth is off and every tier
open. A key without TIERS gets standard and best_effort: premium is granted, never assumed;
a request for a tier its key lacks is refused (403), not downgraded. The `special_tokens`
grant is never assumed, not even with auth off. Keys are compared as SHA-256 digests in
constant time with no early exit, so timing reveals neither which key nor how much matched."""

from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from gateway.config import ConfigError
from gateway.validation import RequestError
from protos import tiers as tier_defs
from protos.echo import clip

ENV_VAR = "CONTINUUM_API_KEYS"
_BEARER = "bearer "
ALL_TIERS = frozenset(range(tier_defs.NUM_TIERS))
DEFAULT_KEY_TIERS = frozenset({tier_defs.STANDARD, tier_defs.BEST_EFFORT})
GRANTS = ("special_tokens",)


def tier_names(tiers: Iterable[int]) -> list[str]:
    return [tier_defs.name(tier) for tier in sorted(tiers)]


def _parse_tiers(text: str, source: str) -> frozenset[int]:
    found = [tier_defs.parse(name) for name in re.split(r"[+,]", text) if name.strip()]
    if None in found or not found:
        raise ConfigError(f"{source}: tiers {text!r} must list some of "
                          f"{', '.join(tier_defs.NAMES)} (separated by '+' or ',')")
    return frozenset(found)


def _parse_grants(text: str, source: str) -> frozenset[str]:
    names = [name.strip() for name in re.split(r"[+,]", text) if name.strip()]
    if not names or any(name not in GRANTS for name in names):
        raise ConfigError(f"{source}: grants {text!r} must list some of {', '.join(GRANTS)} "
                          "(separated by '+' or ',')")
    return frozenset(names)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class Principal:
    """Who a valid key belongs to; `tenant` is "" for a key not bound to one.

    `tiers` are the priority tiers (protos/tiers.py) it may use;
    `special_tokens`: whether its chats may hold control tokens (the `special_tokens` grant)."""

    tenant: str
    tiers: frozenset[int] = ALL_TIERS
    special_tokens: bool = False


@dataclass(frozen=True)
class ApiKeys:
    # (SHA-256 of key, principal)
    entries: tuple[tuple[bytes, Principal], ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    @classmethod
    def parse(cls, specs: Iterable[str], source: str) -> ApiKeys:
        entries = []
        for spec in specs:
            spec = spec.strip()
            if not spec or spec.startswith("#"):
                continue
            key, _, rest = spec.partition(":")
            tenant, has_tiers, tiers_text = rest.partition(":")
            tiers_text, has_grants, grants_text = tiers_text.partition(":")
            key, tenant = key.strip(), tenant.strip()
            if len(key) < 8:
                raise ConfigError(f"{source}: API key {key[:2]!r}... is shorter than 8 characters")
            if tenant and not all(" " <= c <= "~" for c in tenant):
                raise ConfigError(f"{source}: tenant {tenant!r} must be printable ASCII")
            tiers = _parse_tiers(tiers_text, source) if has_tiers else DEFAULT_KEY_TIERS
            grants = _parse_grants(grants_text, source) if has_grants else frozenset()
            entries.append((_digest(key), Principal(tenant, tiers,
                                                    "special_tokens" in grants)))
        return cls(tuple(entries))

    @classmethod
    def load(cls, keys_file: pathlib.Path | None, environ=os.environ) -> ApiKeys:
        """Keys from the file and the environment together; ConfigError names the problem."""
        specs: list[tuple[str, str]] = []
        if keys_file is not None:
            try:
                lines = keys_file.read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise ConfigError(f"--api-keys-file {keys_file}: {exc.strerror}") from exc
            specs += [(line, f"--api-keys-file {keys_file}") for line in lines]
        specs += [(item, ENV_VAR) for item in environ.get(ENV_VAR, "").split(",")]
        entries: list[tuple[bytes, Principal]] = []
        for spec, source in specs:
            entries += cls.parse([spec], source).entries
        if keys_file is not None and not entries:
            raise ConfigError(f"--api-keys-file {keys_file} holds no keys")
        return cls(tuple(entries))

    def check(self, authorization: str | None) -> Principal | None:
        """The principal for an `authorization` value ("Bearer KEY"), or None if refused.

        Always Principal("") (every tier) when auth is off."""
        if not self.enabled:
            return Principal("")
        if not authorization or not authorization[: len(_BEARER)].lower() == _BEARER:
            return None
        presented = _digest(authorization[len(_BEARER):].strip())
        found: Principal | None = None
        for digest, principal in self.entries:  # no early exit: same time for every key
            if hmac.compare_digest(presented, digest):
                found = principal
        return found


UNAUTHENTICATED_MESSAGE = (
    "missing or invalid API key: send 'authorization: Bearer <key>' "
    "(HTTP header or gRPC metadata)"
)


def resolve_tenant(principal: Principal, requested: str) -> str:
    """The tenant to account a request to; RequestError if the key may not act for it."""
    if not principal.tenant:
        return requested
    if requested and requested != principal.tenant:
        raise RequestError(
            f"this API key belongs to tenant {principal.tenant!r}; it cannot submit for "
            f"tenant {clip(requested)} (leave tenant empty)",
            grpc.StatusCode.PERMISSION_DENIED,
            param="tenant",
        )
    return principal.tenant

"""API keys: the file format (KEY, KEY:TENANT, KEY:TENANT:TIERS) and what a key may do."""

from __future__ import annotations

import grpc
import pytest

from gateway.admit.admission import check_tier
from gateway.admit.auth import ALL_TIERS, DEFAULT_KEY_TIERS, ApiKeys, Principal, resolve_tenant
from gateway.config import ConfigError
from gateway.validation import RequestError
from protos.continuum.v1 import generation_pb2

KEYS = ApiKeys.parse([
    "sk-plain-0123456",
    "sk-acme-0123456:acme",
    "sk-vip-01234567:vip:premium+standard+best_effort",
    "sk-batch-0123456::best_effort",
    "# a comment",
    "",
], "test")


def _principal(key: str) -> Principal | None:
    return KEYS.check(f"Bearer {key}")


def test_keys_carry_tenant_and_tiers():
    assert _principal("sk-plain-0123456") == Principal("", DEFAULT_KEY_TIERS)
    assert _principal("sk-acme-0123456") == Principal("acme", DEFAULT_KEY_TIERS)
    assert _principal("sk-vip-01234567") == Principal("vip", ALL_TIERS)
    assert _principal("sk-batch-0123456") == Principal("", frozenset({2}))
    assert _principal("sk-nope-0123456") is None
    assert KEYS.check(None) is None and KEYS.check("Basic abc") is None


def test_auth_off_grants_every_tier():
    assert ApiKeys().check(None) == Principal("", ALL_TIERS)


@pytest.mark.parametrize("spec,words", [
    ("short:acme", "shorter than 8"),
    ("sk-0123456789:acme:gold", "tiers 'gold' must list some of premium"),
    ("sk-0123456789:acme:", "tiers '' must list"),
    ("sk-0123456789:ac\x01me", "printable ASCII"),
])
def test_bad_key_lines_are_config_errors(spec, words):
    with pytest.raises(ConfigError, match=words):
        ApiKeys.parse([spec], "keys.txt")


def test_env_entries_join_tiers_with_plus():
    keys = ApiKeys.load(None, {"CONTINUUM_API_KEYS": "sk-a-01234567:t:premium+standard,"
                                                     "sk-b-01234567"})
    assert keys.check("Bearer sk-a-01234567") == Principal("t", frozenset({0, 1}))
    assert keys.check("Bearer sk-b-01234567") == Principal("", DEFAULT_KEY_TIERS)


def test_premium_needs_the_tier_and_the_refusal_names_it():
    with pytest.raises(RequestError) as refused:
        check_tier(Principal("acme", DEFAULT_KEY_TIERS), generation_pb2.PRIORITY_PREMIUM)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.param == "priority"
    assert "may not use priority 'premium'; it may use standard, best_effort" in (
        refused.value.message)
    for priority in (generation_pb2.PRIORITY_UNSPECIFIED, generation_pb2.PRIORITY_STANDARD,
                     generation_pb2.PRIORITY_BEST_EFFORT):
        check_tier(Principal("acme", DEFAULT_KEY_TIERS), priority)
    check_tier(Principal("vip", ALL_TIERS), generation_pb2.PRIORITY_PREMIUM)
    with pytest.raises(RequestError, match="may not use priority 'standard'"):
        check_tier(Principal("", frozenset({2})), generation_pb2.PRIORITY_UNSPECIFIED)


def test_a_bound_key_cannot_act_for_another_tenant():
    assert resolve_tenant(Principal("acme"), "") == "acme"
    with pytest.raises(RequestError) as refused:
        resolve_tenant(Principal("acme"), "bob")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED

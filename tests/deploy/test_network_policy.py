"""No NetworkPolicy of deploy/k8s admits a pod of another namespace by a label that
pod's owner can set: every peer is a pod label of the policy's own namespace, or a pod
label together with one namespace named by ``kubernetes.io/metadata.name`` (the KV event
stream it guards carries every tenant's token ids: docs/security.md)."""

from __future__ import annotations

import pytest

from .test_manifests import OVERLAYS, overlay


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, overlay(request.param)


# The namespace label the API server sets to the namespace's own name; nobody can set it
# to another (a label any namespace owner may set proves nothing).
NAMESPACE_NAME = "kubernetes.io/metadata.name"


def _peer_problem(peer: dict) -> str | None:
    """Why a NetworkPolicy ``from`` peer could admit pods it should not (None: it is
    safe). A podSelector alone matches pods of the policy's own namespace only; a
    namespaceSelector admits every pod of the namespaces it matches unless a
    podSelector in the same peer narrows it (two peers are an OR, not an AND)."""
    if set(peer) - {"podSelector", "namespaceSelector"}:
        return "an ipBlock (or unknown peer) admits addresses, not pods"
    pods = peer.get("podSelector")
    if not pods or not pods.get("matchLabels") or pods.get("matchExpressions"):
        return "no podSelector with matchLabels: every pod of the namespace(s)"
    namespaces = peer.get("namespaceSelector")
    if namespaces is None:
        return None  # this namespace only
    if set(namespaces) != {"matchLabels"} or \
            set(namespaces["matchLabels"]) != {NAMESPACE_NAME}:
        return ("a namespaceSelector other than one kubernetes.io/metadata.name matches "
                "namespaces by labels their owners set (or, empty, every namespace)")
    return None


def test_no_network_policy_admits_pods_of_other_namespaces_by_label(rendered):
    policies = [o for o in rendered[1] if o["kind"] == "NetworkPolicy"]
    assert policies
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            # No `from`: every source; no `ports`: every port of the selected pods.
            assert rule.get("from") and rule.get("ports"), rule
            for peer in rule["from"]:
                assert _peer_problem(peer) is None, (_peer_problem(peer), peer)


@pytest.mark.parametrize("peer", [
    {"namespaceSelector": {}, "podSelector": {"matchLabels": {"a": "b"}}},
    {"namespaceSelector": {"matchLabels": {"team": "x"}},
     "podSelector": {"matchLabels": {"a": "b"}}},
    {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME: "monitoring"}}},
    {"podSelector": {}},
    {"ipBlock": {"cidr": "0.0.0.0/0"}},
])
def test_the_peer_check_refuses_what_admits_other_namespaces(peer):
    assert _peer_problem(peer) is not None

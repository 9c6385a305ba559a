"""Per-client caps, so one client cannot take what the gateway holds for all of them.

A client is the TCP peer's address or, from a `--trusted-proxies` peer, the last
``X-Forwarded-For`` entry (the one that proxy wrote; anything left of it is forgeable).
Without the flag the header is ignored. A trusted proxy's own connections are not counted.

* Open HTTP connections per address: 256 (nginx's ``limit_conn`` is per address too; an
  eighth of the gateway's 2,048, so eight greedy clients cannot fill it).
* Generation streams per address, HTTP and gRPC together: 512 (room for a service
  multiplexing many users, while one runaway client cannot hold every queue slot); past
  it 429 / RESOURCE_EXHAUSTED with a retry hint, before any parsing."""

from __future__ import annotations

import collections
import contextlib
import ipaddress
from collections.abc import Iterator

import grpc

from gateway.validation import RequestError

MAX_CONNECTIONS_PER_CLIENT = 256
MAX_STREAMS_PER_CLIENT = 512
RETRY_AFTER_MS = 1000
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str | None) -> tuple[Network, ...]:
    """``"10.0.0.0/8, 192.168.1.7"`` as networks; ValueError names a bad entry."""
    networks = []
    for entry in (text or "").split(","):
        if entry.strip():
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError as exc:
                raise ValueError(f"--trusted-proxies entry {entry.strip()!r} is not an IP "
                                 "address or CIDR network") from exc
    return tuple(networks)


def grpc_peer_ip(peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678`` → the address; others unchanged."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


class ClientLimits:
    """Counts per client address; used from the event loop only."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS_PER_CLIENT,
                 max_streams: int = MAX_STREAMS_PER_CLIENT,
                 trusted_proxies: tuple[Network, ...] = ()):
        self.max_connections = max_connections
        self.max_streams = max_streams
        self._trusted = trusted_proxies
        self._connections: collections.Counter[str] = collections.Counter()
        self._streams: collections.Counter[str] = collections.Counter()

    def trusted(self, peer_ip: str) -> bool:
        if not self._trusted:
            return False
        try:
            address = ipaddress.ip_address(peer_ip)
        except ValueError:
            return False
        return any(address in network for network in self._trusted)

    def client_of(self, peer_ip: str, forwarded_for: str | None) -> str:
        """The client address a request is counted under (see the module docstring)."""
        if forwarded_for and self.trusted(peer_ip):
            last = forwarded_for.rsplit(",", 1)[-1].strip()
            if last:
                return last[:64]
        return peer_ip

    def at_connection_cap(self, peer_ip: str) -> bool:
        return not self.trusted(peer_ip) and self._connections[peer_ip] >= self.max_connections

    def open_connection(self, peer_ip: str) -> None:
        """Counts a new connection from ``peer_ip`` (the caller checked the cap)."""
        if not self.trusted(peer_ip):
            self._connections[peer_ip] += 1

    def close_connection(self, peer_ip: str) -> None:
        if self.trusted(peer_ip) or not self._connections[peer_ip]:
            return
        self._connections[peer_ip] -= 1
        if not self._connections[peer_ip]:
            del self._connections[peer_ip]

    def acquire(self, client: str) -> None:
        """Takes one of ``client``'s stream slots; RequestError (429) if none is free."""
        if self._streams[client] >= self.max_streams:
            raise RequestError(
                f"this client address has {self._streams[client]} requests in flight, the "
                f"gateway's limit per client (--max-streams-per-client); retry when one "
                "ends", grpc.StatusCode.RESOURCE_EXHAUSTED, error_code="rate_limit_exceeded")
        self._streams[client] += 1

    def release(self, client: str) -> None:
        self._streams[client] -= 1
        if self._streams[client] <= 0:
            del self._streams[client]

    @contextlib.contextmanager
    def stream(self, client: str) -> Iterator[None]:
        self.acquire(client)
        try:
            yield
        finally:
            self.release(client)

    def connection_refusal(self) -> str:
        return (f"this client address holds {self.max_connections} open connections, the "
                "gateway's limit per client (--http-max-connections-per-client); reuse "
                "them (keep-alive) or close some")

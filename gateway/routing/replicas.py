"""The scheduler replicas a gateway can submit to, and which one to pick.

Stats are polled in the background; a request goes to the healthy replica with the least
load (docs/operations.md, "Several scheduler replicas"), counting the requests sent since
the last poll so a burst spreads. A replica whose Stats fail, without an executor, or
draining is skipped while any other will do. Every call carries the internal secret
(runtime/internal_auth.py) through a client interceptor; given credentials, every channel
is TLS. ``dns:///NAME:PORT`` is a set, re-resolved every REFRESH_S: a new address joins
after its first poll, one that left is drained (RETIRE_GRACE_S at most), and a failed
lookup keeps the last set (a DNS blip must not empty the gateway)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Awaitable, Callable

import grpc
import structlog

from gateway.routing.mux import Mux, SchedulerStream
from gateway.routing.upstream import CHANNEL_OPTIONS
from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc
from runtime import internal_auth
from runtime.aio import cancel_all

POLL_S = 0.5
DNS_SCHEME = "dns:///"
# How often a dns:/// name is resolved again: a new pod is used within this. (gRPC's own
# dns: resolver re-resolves only when a connection fails, and would balance inside one
# channel, not by each replica's Stats.)
REFRESH_S = 5.0
# A replica that left DNS keeps its in-flight calls this long (a terminating pod's
# scheduler drains for its --grace-period, 30 s in deploy/k8s) before they are cut.
RETIRE_GRACE_S = 60.0
# (host, port) -> the addresses ("IP:PORT", "[IPv6]:PORT") it resolves to now.
Resolver = Callable[[str, int], Awaitable[list[str]]]
_log = structlog.get_logger("gateway.replicas")


class _FromEnvironment:
    """ReplicaSet's default secret: read it with internal_auth.load_secret()."""


FROM_ENVIRONMENT = _FromEnvironment()


class _WithSecret:
    """Adds the internal-auth metadata to a call's details."""

    def __init__(self, secret: bytes) -> None:
        self._metadata = internal_auth.metadata(secret)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _UnaryWithSecret(_WithSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamWithSecret(_WithSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def split_dns(entry: str) -> tuple[str, int] | None:
    """``dns:///NAME:PORT`` -> (NAME, PORT); None for a plain HOST:PORT."""
    if not entry.startswith(DNS_SCHEME):
        return None
    host, _, port = entry.removeprefix(DNS_SCHEME).rpartition(":")
    return host, int(port)


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` has now, sorted; OSError when the lookup fails."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(found)


def _estimate(replica: Replica) -> tuple[float, float, float]:
    waiting, usage, running = replica.load
    return waiting + replica.routed, usage, running


def auth_interceptors(secret: bytes | None) -> list[grpc.aio.ClientInterceptor] | None:
    """Interceptors that send ``secret`` on every unary and server-streaming call (one
    object per kind: grpc.aio files an interceptor under its first kind only)."""
    return None if secret is None else [_UnaryWithSecret(secret), _StreamWithSecret(secret)]


@dataclasses.dataclass(eq=False)
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    healthy: bool = True  # optimistic until the first poll says otherwise
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    routed: int = 0  # picked since the last poll was sent: not yet in ``load``
    stats: scheduler_pb2.StatsResponse | None = None  # the latest successful poll
    mux: Mux | None = None  # this gateway's SubmitMany call to it (set by ReplicaSet)

    def submit(self, request: scheduler_pb2.SubmitRequest,
               timeout: float | None) -> SchedulerStream:
        """Starts ``request`` as a stream on this gateway's SubmitMany call to the replica."""
        return self.mux.submit(request, timeout)


class ReplicaSet:
    def __init__(self, addresses: list[str],
                 secret: bytes | None | _FromEnvironment = FROM_ENVIRONMENT,
                 resolver: Resolver | None = None, refresh_s: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None, max_call_age_s: float = 0.0) -> None:
        """``addresses``: HOST:PORT and ``dns:///NAME:PORT``. ``secret``: None opts out;
        by default the environment's (internal_auth.SecretError when missing or unusable).
        ``credentials``: TLS (None: plaintext), checking ``server_name`` when given.
        ``max_call_age_s``: rotate the SubmitMany call at that age (0: never)."""
        if isinstance(secret, _FromEnvironment):
            secret = internal_auth.load_secret()
        self._interceptors = auth_interceptors(secret)
        self._metadata = internal_auth.metadata(secret)
        self._max_call_age_s = max_call_age_s
        self._credentials = credentials
        self._options = CHANNEL_OPTIONS + (
            (("grpc.ssl_target_name_override", server_name),) if server_name else ())
        self._targets = addresses
        self._names = [t for t in map(split_dns, addresses) if t is not None]
        self._resolver = resolver or resolve
        self._refresh_s = REFRESH_S if refresh_s is None else refresh_s
        self._resolved: dict[tuple[str, int], list[str]] = {name: [] for name in self._names}
        self.replicas = [self._connect(a) for a in addresses if split_dns(a) is None]
        self._retiring: dict[asyncio.Task, Replica] = {}  # channel.close(grace) under way
        self._tasks: list[asyncio.Task] = []

    def _connect(self, address: str) -> Replica:
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=self._options,
                                                interceptors=self._interceptors)
        else:
            channel = grpc.aio.secure_channel(address, self._credentials, options=self._options,
                                              interceptors=self._interceptors)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return Replica(address, channel, stub,
                       mux=Mux(stub, self._metadata, self._max_call_age_s))

    @property
    def addresses(self) -> str:
        """What error messages name: every replica, and what each dns:/// name holds."""
        parts = []
        for target in self._targets:
            name = split_dns(target)
            if name is None:
                parts.append(target)
            else:
                found = ", ".join(self._resolved[name]) or "no address resolved yet"
                parts.append(f"{target} ({found})")
        return ", ".join(parts)

    def snapshot(self) -> list[tuple[str, Replica]]:
        return [(r.address, r) for r in self.replicas]

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll_forever())]
        if self._names:
            self._tasks.append(loop.create_task(self._discover_forever()))

    async def close(self) -> None:
        await cancel_all(self._tasks)
        retiring = dict(self._retiring)
        await cancel_all(retiring)
        for replica in [*self.replicas, *retiring.values()]:
            await replica.mux.close()
            await replica.channel.close()

    def pick(self, exclude: set[str] = frozenset()) -> Replica | None:
        """The least-loaded healthy replica not in ``exclude`` (else any left), which
        is counted as having one more request queued until its next poll answers."""
        left = [r for r in self.replicas if r.address not in exclude]
        healthy = [r for r in left if r.healthy]
        chosen = min(healthy or left, key=_estimate, default=None)
        if chosen is not None:
            chosen.routed += 1
        return chosen

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(r) for r in list(self.replicas)))
            await asyncio.sleep(POLL_S)

    async def _discover_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._refresh_s)

    async def refresh(self) -> None:
        """Resolves every dns:/// name once and applies the difference: new addresses
        join after their first poll, addresses gone are retired."""
        for host, port in self._names:
            try:
                found = await self._resolver(host, port)
            except OSError as exc:  # socket.gaierror included: keep the last set
                _log.warning("replica lookup failed; keeping the last set", name=host,
                             port=port, error=str(exc), replicas=self._resolved[(host, port)])
                continue
            self._resolved[(host, port)] = found
        wanted = {a for found in self._resolved.values() for a in found}
        static = {t for t in self._targets if split_dns(t) is None}
        current = {r.address for r in self.replicas}
        joined = [self._connect(a) for a in sorted(wanted - current)]
        try:
            await asyncio.gather(*(self._poll(r) for r in joined))
        except asyncio.CancelledError:  # closing: these channels are nobody's yet
            await asyncio.gather(*(r.channel.close() for r in joined))
            raise
        for replica in joined:
            _log.info("replica joined", address=replica.address, healthy=replica.healthy)
        left = [r for r in self.replicas if r.address not in wanted | static]
        self.replicas = [r for r in self.replicas if r not in left] + joined
        for replica in left:
            _log.info("replica left; draining it", address=replica.address)
            replica.mux.retire()  # its call half-closes once its streams end
            task = asyncio.get_running_loop().create_task(
                replica.channel.close(grace=RETIRE_GRACE_S))
            self._retiring[task] = replica
            task.add_done_callback(lambda done: self._retiring.pop(done, None))

    async def _poll(self, replica: Replica) -> None:
        routed = replica.routed  # what this poll's answer already counts
        try:
            stats = await replica.stub.Stats(scheduler_pb2.StatsRequest(), timeout=POLL_S * 2)
        except grpc.aio.AioRpcError:
            healthy = False
        else:
            replica.stats = stats
            healthy = stats.executor_ready and not stats.draining
            usage = 1 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks \
                else 0.0
            replica.load = (float(stats.num_waiting), usage, float(stats.num_running))
            replica.routed = max(0, replica.routed - routed)
        if healthy != replica.healthy:
            _log.info("replica health changed", address=replica.address, healthy=healthy)
        replica.healthy = healthy

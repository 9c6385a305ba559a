"""The scheduler replicas a gateway can submit to, and which one to pick.

Every replica's Stats are polled in the background; a request goes to the
healthy replica with the least load (queue first, then KV usage, then running
sequences). A replica whose Stats fail, that has no executor, or that is
draining is skipped while any other will do.

Each replica's channel carries the per-deployment internal secret
(``protos/internal_auth.py``) on every call, Submit, Abort and Stats alike,
through a client interceptor: whoever makes a call on ``replica.stub`` need not
know about it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import structlog

from gateway.upstream import CHANNEL_OPTIONS
from protos import internal_auth
from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc

POLL_S = 0.5
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


def auth_interceptors(secret: bytes | None) -> list[grpc.aio.ClientInterceptor] | None:
    """Interceptors that send ``secret`` on every unary and server-streaming call.

    One object per kind: grpc.aio files an interceptor under the first kind it
    implements only."""
    return None if secret is None else [_UnaryWithSecret(secret), _StreamWithSecret(secret)]


@dataclasses.dataclass(eq=False)
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    healthy: bool = True  # optimistic until the first poll says otherwise
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    stats: scheduler_pb2.StatsResponse | None = None  # the latest successful poll


class ReplicaSet:
    def __init__(self, addresses: list[str],
                 secret: bytes | None | _FromEnvironment = FROM_ENVIRONMENT) -> None:
        """``secret``: the internal secret every call carries (None: none, the opt-out);
        by default the environment's, which raises internal_auth.SecretError when
        it is missing or unusable (``python -m gateway`` turns that into exit 2)."""
        if isinstance(secret, _FromEnvironment):
            secret = internal_auth.load_secret()
        interceptors = auth_interceptors(secret)
        self.replicas = []
        for address in addresses:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                                interceptors=interceptors)
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            self.replicas.append(Replica(address, channel, stub))
        self._task: asyncio.Task | None = None

    @property
    def addresses(self) -> str:
        return ", ".join(r.address for r in self.replicas)

    def snapshot(self) -> list[tuple[str, Replica]]:
        return [(r.address, r) for r in self.replicas]

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for replica in self.replicas:
            await replica.channel.close()

    def pick(self, exclude: set[str] = frozenset()) -> Replica | None:
        """The least-loaded healthy replica not in ``exclude`` (else any left)."""
        left = [r for r in self.replicas if r.address not in exclude]
        healthy = [r for r in left if r.healthy]
        return min(healthy or left, key=lambda r: r.load, default=None)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(r) for r in self.replicas))
            await asyncio.sleep(POLL_S)

    async def _poll(self, replica: Replica) -> None:
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
        if healthy != replica.healthy:
            _log.info("replica health changed", address=replica.address, healthy=healthy)
        replica.healthy = healthy

"""Replica discovery by DNS (``--scheduler dns:///NAME:PORT``, a Kubernetes headless
Service): addresses that appear join after their first Stats poll, addresses that
leave are drained (their in-flight streams finish, nothing new goes to them), a
failed lookup keeps the last set. DNS servers cannot run here, so the resolver is
injected (it returns what a headless Service would); the real one is checked on
``localhost``, and one test runs a real gateway whose replica set changes."""

from __future__ import annotations

import asyncio
import pathlib
import socket

import pytest

from gateway.config import ConfigError, GatewayConfig
from gateway.routing import replicas as replicas_module
from gateway.routing.replicas import ReplicaSet, resolve, split_dns
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2

from .harness import (
    FakeScheduler,
    collect,
    fake_scheduler,
    free_port,
    gateway,
    generation_stub,
    run,
)

NAME = ("continuum-replica", 50061)
TARGET = "dns:///continuum-replica:50061"


class Answers:
    """A resolver whose answer the test sets; ``error`` makes the lookup fail."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.error: OSError | None = None
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.error is not None:
            raise self.error
        return list(self.addresses)


def _events(n: int) -> list[scheduler_pb2.TokenEvent]:
    events = [scheduler_pb2.TokenEvent(token_ids=[100 + i]) for i in range(n)]
    events[-1].finish_reason = sampling_pb2.FINISH_REASON_LENGTH
    return events


def _addresses(replica_set: ReplicaSet) -> list[str]:
    return [r.address for r in replica_set.replicas]


def test_split_dns_and_the_config_accept_only_name_and_port():
    assert split_dns(TARGET) == NAME
    assert split_dns("10.0.0.1:50061") is None
    config = GatewayConfig(model_dir=pathlib.Path("m"),
                           scheduler_address=f"{TARGET},127.0.0.1:50062")
    assert config.scheduler_addresses == [TARGET, "127.0.0.1:50062"]
    for bad in ("dns:///continuum-replica", "dns:///:50061", "dns:///name:http",
                "dns:///name:70000"):
        with pytest.raises(ConfigError, match="dns:///NAME:PORT"):
            GatewayConfig(model_dir=pathlib.Path("m"), scheduler_address=bad)


def test_the_real_resolver_finds_localhost():
    port = free_port()
    found = run(resolve("localhost", port))
    assert f"127.0.0.1:{port}" in found
    assert all(a.endswith(f":{port}") for a in found)
    with pytest.raises(OSError):
        run(resolve("no-such-host.invalid", port))


def test_a_real_name_brings_in_the_scheduler_behind_it():
    """No injected resolver: dns:///localhost:PORT finds the scheduler on 127.0.0.1
    (an IPv6 ::1 answer, where nothing listens, joins unhealthy and is not picked)."""
    async def scenario():
        async with fake_scheduler(FakeScheduler()) as address:
            port = int(address.rpartition(":")[2])
            replica_set = ReplicaSet([f"dns:///localhost:{port}"], secret=None)
            try:
                await replica_set.refresh()
                assert address in _addresses(replica_set)
                assert replica_set.pick().address == address and replica_set.any_healthy
            finally:
                await replica_set.close()

    run(scenario())


def test_replicas_join_after_a_poll_leave_when_gone_and_survive_a_failed_lookup():
    async def scenario():
        async with fake_scheduler(FakeScheduler()) as a, fake_scheduler(FakeScheduler()) as b:
            dead = f"127.0.0.1:{free_port()}"
            answers = Answers(a)
            replica_set = ReplicaSet([TARGET, b], secret=None, resolver=answers)
            try:
                assert _addresses(replica_set) == [b]  # nothing resolved before refresh
                assert "no address resolved yet" in replica_set.addresses
                await replica_set.refresh()
                assert answers.asked == [NAME]
                assert sorted(_addresses(replica_set)) == sorted([a, b])
                assert f"{TARGET} ({a})" in replica_set.addresses
                # A new address is polled before it joins: a dead one joins unhealthy,
                # so it is never picked while a healthy replica is left.
                answers.addresses = [a, dead]
                await replica_set.refresh()
                [joined] = [r for r in replica_set.replicas if r.address == dead]
                assert joined.healthy is False and joined.stats is None
                assert {replica_set.pick().address for _ in range(5)} <= {a, b}
                # A lookup that fails keeps the last set instead of draining it.
                answers.error = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
                await replica_set.refresh()
                assert sorted(_addresses(replica_set)) == sorted([a, b, dead])
                # Gone from DNS: retired. A static replica is never retired.
                answers.error, answers.addresses = None, []
                await replica_set.refresh()
                assert _addresses(replica_set) == [b]
                assert replica_set.pick({b}) is None
            finally:
                await replica_set.close()

    run(scenario())


def test_a_replica_that_leaves_finishes_its_in_flight_stream():
    """Draining, not cutting: the retired replica's channel closes with a grace, so a
    stream under way ends normally (the terminating pod's scheduler drains it)."""
    async def scenario():
        slow = FakeScheduler(events=_events(8), delay_s=0.05)
        async with fake_scheduler(slow) as a:
            answers = Answers(a)
            replica_set = ReplicaSet([TARGET], secret=None, resolver=answers)
            try:
                await replica_set.refresh()
                [replica] = replica_set.replicas
                call = replica.submit(scheduler_pb2.SubmitRequest(request_id="r1"), 10)
                first = await call.read()
                answers.addresses = []
                await replica_set.refresh()
                assert replica_set.replicas == [] and replica_set.pick() is None
                rest = [await call.read()]
                while not rest[-1].finish_reason:
                    rest.append(await call.read())
                assert [e.token_ids[0] for e in [first, *rest]] == [100 + i for i in range(8)]
                assert rest[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
                assert slow.completed.is_set() and not slow.cancelled.is_set()
            finally:
                await replica_set.close()

    run(scenario())


def test_a_gateway_follows_its_replica_set_through_dns(tokenizer, monkeypatch):
    """A real gateway on ``dns:///``: requests go to the replica DNS names now; when
    the set changes (a pod replaced), new requests go to the new one."""
    answers = Answers()
    monkeypatch.setattr(replicas_module, "resolve", answers)
    monkeypatch.setattr(replicas_module, "REFRESH_S", 0.05)
    request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=3)

    async def wait_for(condition) -> None:
        for _ in range(400):  # up to 20 s: conditions, not speed
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the gateway's replica set did not change")

    async def scenario():
        first, second = FakeScheduler(events=_events(3)), FakeScheduler(events=_events(3))
        async with fake_scheduler(first) as a, fake_scheduler(second) as b, \
                gateway(tokenizer, TARGET) as (running, channel):
            stub = generation_stub(channel)
            answers.addresses = [a]
            await wait_for(lambda: _addresses(running.replicas) == [a])
            responses = await collect(stub.Generate(request, timeout=10))
            assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert (len(first.submitted), len(second.submitted)) == (1, 0)
            answers.addresses = [b]  # the first pod went away, a new one came
            await wait_for(lambda: _addresses(running.replicas) == [b])
            for _ in range(2):
                await collect(stub.Generate(request, timeout=10))
            assert (len(first.submitted), len(second.submitted)) == (1, 2)

    run(scenario())


class Queued(FakeScheduler):
    """Healthy and idle but for ``waiting`` requests in its queue."""

    def __init__(self, waiting: int) -> None:
        super().__init__()
        self.waiting = waiting

    async def Stats(self, request, context):
        stats = await super().Stats(request, context)
        stats.num_waiting = self.waiting
        return stats


def test_a_burst_inside_one_poll_gap_spreads_over_the_replicas(monkeypatch):
    """Picks between two polls count as queued on the replica picked: a burst of six
    to an idle and a twice-queued replica goes 4 and 2, not 6 and 0, and once the
    next poll has answered, the picks it counts are no longer added twice."""
    monkeypatch.setattr(replicas_module, "POLL_S", 0.05)

    async def scenario():
        async with fake_scheduler(Queued(0)) as idle, fake_scheduler(Queued(2)) as busy:
            replica_set = ReplicaSet([busy, idle], secret=None)
            replica_set.start()
            try:
                while any(r.stats is None for r in replica_set.replicas):
                    await asyncio.sleep(0.01)
                picked = [replica_set.pick().address for _ in range(6)]
                assert picked.count(idle) == 4 and picked.count(busy) == 2, picked
                assert picked[:2] == [idle, idle]  # the queued one only once it is level
                for _ in range(200):  # the next poll's answer counts those picks
                    await asyncio.sleep(0.01)
                    if all(r.routed == 0 for r in replica_set.replicas):
                        break
                assert [r.routed for r in replica_set.replicas] == [0, 0]
                assert replica_set.pick().address == idle
            finally:
                await replica_set.close()

    run(scenario())

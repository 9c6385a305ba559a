"""The gateway's cap on concurrent gRPC calls (``--grpc-max-concurrent-rpcs``,
gateway/rpc/rpc_limit.py) holds over all connections: the call past it ends at once
RESOURCE_EXHAUSTED, naming the flag, with the retry pushback trailers; health checks still pass
while it is full; once a call ends, its slot serves the next one."""

from __future__ import annotations

import asyncio
import pathlib

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from gateway.config import ConfigError, GatewayConfig
from gateway.rpc.rpc_limit import RpcLimit
from protos.continuum.v1 import generation_pb2
from protos.pushback import PUSHBACK_KEY, RETRY_AFTER_KEY

from .harness import collect, fake_scheduler, gateway, generation_stub, run
from .test_grpc_streams_limit import Holding

CAP = 2


def _request(i: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="hi", request_id=f"r{i}")


def test_the_call_past_the_cap_is_refused_with_a_retry_hint_and_slots_come_back(tokenizer):
    async def scenario():
        held = Holding()
        async with fake_scheduler(held) as address, \
                gateway(tokenizer, address, grpc_max_concurrent_rpcs=CAP) as (running, channel):
            # One connection per call: the cap is the gateway's, not a connection's.
            channels = [grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
                        for _ in range(CAP)]
            tasks = [asyncio.create_task(collect(generation_stub(c).Generate(
                _request(i), timeout=30))) for i, c in enumerate(channels)]
            for _ in range(200):
                if held.holding == CAP:
                    break
                await asyncio.sleep(0.05)
            assert held.holding == CAP

            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(generation_stub(channel).Generate(_request(CAP), timeout=30))
            assert loop.time() - start < 2.0  # answered at once, not queued
            error = refused.value
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"limit of {CAP} concurrent" in error.details()
            assert "--grpc-max-concurrent-rpcs" in error.details()
            trailers = dict(error.trailing_metadata())
            assert trailers[PUSHBACK_KEY] == trailers[RETRY_AFTER_KEY] == "1000"
            assert len(held.submitted) == CAP  # the refused call reached no scheduler
            assert 'code="RESOURCE_EXHAUSTED"' in running.metrics.render().decode()

            # Probes are not counted with Generate: the health check still answers.
            check = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING

            held.release.set()
            answers = await asyncio.gather(*tasks)
            assert all(any(r.finish_reason for r in answer) for answer in answers)
            await asyncio.sleep(0.1)  # the finished calls' slots are released
            answer = await collect(generation_stub(channel).Generate(_request(CAP + 1),
                                                                     timeout=30))
            assert any(r.finish_reason for r in answer)
            for c in channels:
                await c.close()

    run(scenario())


def test_the_cap_must_be_positive():
    with pytest.raises(ConfigError, match="--grpc-max-concurrent-rpcs"):
        GatewayConfig(model_dir=pathlib.Path("m"), scheduler_address="127.0.0.1:1",
                      grpc_max_concurrent_rpcs=0)


def test_streaming_calls_are_counted_and_released(tokenizer):
    """Reflection (a stream-stream async generator) and health Watch (a coroutine that
    writes) pass through the counting wrappers, and their slots come back."""
    async def scenario():
        held = Holding()
        held.release.set()  # streams end as soon as they begin
        async with fake_scheduler(held) as address, \
                gateway(tokenizer, address, grpc_max_concurrent_rpcs=1) as (_, channel):
            for _ in range(3):  # one slot, used again and again
                call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                    timeout=5)
                [reply] = [r async for r in call]
                assert any(s.name == "continuum.v1.Generation"
                           for s in reply.list_services_response.service)
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            await asyncio.sleep(0.1)
            # The one slot is free again for a Generate:
            answer = await collect(generation_stub(channel).Generate(_request(0), timeout=30))
            assert answer

    run(scenario())


def test_health_calls_have_a_pool_of_their_own():
    """A flood of health watches fills only the health pool: the next watch is refused,
    naming health calls, and the calls of the other pool are still served."""
    async def scenario():
        limit = RpcLimit(1, "/grpc.health.v1.Health/", max_health_rpcs=2)
        server = grpc.aio.server(interceptors=[limit])
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((reflection.SERVICE_NAME,), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
                       for _ in range(2)]
            for watch in watches:
                await watch.read()
            assert limit.active == {False: 0, True: 2}
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit of 2 concurrent health calls" in refused.value.details()
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            assert [r async for r in call]
            for watch in watches:
                watch.cancel()
            for _ in range(50):
                if limit.active == {False: 0, True: 0}:
                    break
                await asyncio.sleep(0.02)
            assert limit.active == {False: 0, True: 0}
        await server.stop(0)

    run(scenario())

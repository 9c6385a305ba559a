"""Per-client caps and the probe listener: one client cannot take what the gateway
holds for all of them, and the kubelet's probes are answered whatever the crowd. A real
gateway (gRPC and aiohttp) over loopback sockets; a second client address is
127.0.0.2 (all of 127/8 is loopback)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from gateway.config import ConfigError, GatewayConfig
from gateway.edge.client_limits import ClientLimits, grpc_peer_ip, parse_networks
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2
from protos.pushback import PUSHBACK_KEY, RETRY_AFTER_KEY

from .harness import FakeScheduler, collect, fake_scheduler, gateway, generation_stub, run

GENEROUS_S = 20.0
SLOW = FakeScheduler(events=[scheduler_pb2.TokenEvent(token_ids=[42])] * 3
                     + [scheduler_pb2.TokenEvent(token_ids=[42],
                                                 finish_reason=sampling_pb2.FINISH_REASON_LENGTH)],
                     delay_s=0.5)


def test_the_client_is_the_peer_unless_a_trusted_proxy_names_it():
    limits = ClientLimits(trusted_proxies=parse_networks("10.0.0.0/8, 192.168.1.7"))
    assert limits.client_of("203.0.113.5", "1.2.3.4") == "203.0.113.5"  # forged: ignored
    # The entry the trusted proxy appended is the rightmost; left of it is the client's.
    assert limits.client_of("10.1.2.3", "6.6.6.6, 198.51.100.9") == "198.51.100.9"
    assert limits.client_of("192.168.1.7", None) == "192.168.1.7"
    assert ClientLimits().client_of("10.1.2.3", "1.2.3.4") == "10.1.2.3"  # none trusted
    assert grpc_peer_ip("ipv4:127.0.0.1:5555") == "127.0.0.1"
    assert grpc_peer_ip("ipv6:[::1]:5555") == "::1"


def test_bad_limit_flags_are_refused_with_their_name(tmp_path):
    for fields, words in (({"trusted_proxies": "10.0.0.0/8,nope"}, "'nope' is not an IP"),
                          ({"max_streams_per_client": 0}, "--max-streams-per-client"),
                          ({"probe_port": 70000}, "--probe-port must be >= 0 and <= 65535"),
                          ({"probe_port": 9000, "http_port": 9000}, "pick its own port")):
        with pytest.raises(ConfigError, match=words):
            GatewayConfig(model_dir=tmp_path, scheduler_address="127.0.0.1:1", **fields)


async def _completion(session: aiohttp.ClientSession, url: str) -> tuple[int, dict, dict]:
    async with session.post(url, json={"prompt": "hi", "max_tokens": 4}) as response:
        return response.status, dict(response.headers), await response.json()


def test_streams_past_the_per_client_cap_are_429_on_http_and_resource_exhausted_on_grpc(
        tokenizer):
    async def scenario():
        async with fake_scheduler(SLOW) as address, \
                gateway(tokenizer, address, http_port=0, max_streams_per_client=2) \
                as (running, channel):
            url = f"http://127.0.0.1:{running.http_port}/v1/completions"
            async with aiohttp.ClientSession() as mine, aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as other:
                held = [asyncio.create_task(_completion(mine, url)) for _ in range(2)]
                await asyncio.sleep(0.3)  # both admitted and streaming
                over_http = await _completion(mine, url)
                try:
                    await collect(generation_stub(channel).Generate(
                        generation_pb2.GenerateRequest(prompt="hi", max_tokens=4), timeout=10))
                    over_grpc = None
                except grpc.aio.AioRpcError as exc:
                    over_grpc = exc
                from_elsewhere = await _completion(other, url)
                done = await asyncio.gather(*held)
                again = await _completion(mine, url)  # the slots were given back
                return over_http, over_grpc, from_elsewhere, done, again

    over_http, over_grpc, from_elsewhere, done, again = run(scenario(), timeout_s=60)
    status, headers, body = over_http
    assert status == 429 and headers["Retry-After"] == "1"
    assert "--max-streams-per-client" in body["error"]["message"]
    assert over_grpc is not None and over_grpc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(over_grpc.trailing_metadata())
    assert trailers[PUSHBACK_KEY] == trailers[RETRY_AFTER_KEY] == "1000"
    assert from_elsewhere[0] == 200 and [d[0] for d in done] == [200, 200] and again[0] == 200


async def _idle_crowd(port: int, count: int) -> list:
    crowd = []
    for _ in range(count):
        try:
            crowd.append(await asyncio.open_connection("127.0.0.1", port))
        except OSError:
            break
    return crowd


def test_a_crowd_of_idle_sockets_leaves_probes_and_other_clients_served(tokenizer):
    """One client opens 2,100 connections that send nothing, more than the gateway holds
    (default caps): /live and /health answer 200 on the probe listener, another client's
    request is served, and the crowd's own client is answered 429 with Retry-After (its
    silent sockets may have requests on the wire, so none is closed for it)."""
    async def scenario():
        async with fake_scheduler(FakeScheduler(events=SLOW.events)) as address, \
                gateway(tokenizer, address, http_port=0, probe_port=0) as (running, _):
            crowd = await _idle_crowd(running.http_port, 2100)
            await asyncio.sleep(0.5)
            async with aiohttp.ClientSession() as probe, aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as other:
                base = f"http://127.0.0.1:{running.probe_port}"
                answers = []
                api = f"http://127.0.0.1:{running.http_port}"
                for url in (base + "/live", base + "/health", api + "/live"):
                    async with probe.get(url) as response:
                        answers.append((response.status, await response.json()))
                served = await _completion(
                    other, f"http://127.0.0.1:{running.http_port}/v1/completions")
            for _, writer in crowd:
                writer.close()
            return len(crowd), answers, served

    opened, answers, served = run(scenario(), timeout_s=60)
    assert opened == 2100  # past the client's cap, each let in to be answered a refusal
    assert answers[:2] == [(200, {"status": "alive"}), (200, {"status": "serving"})]
    assert answers[2][0] == 429
    assert "--http-max-connections-per-client" in answers[2][1]["error"]["message"]
    assert served[0] == 200, json.dumps(served[2])[:300]

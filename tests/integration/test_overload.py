"""Backpressure on the real stack: a full queue is refused at once — HTTP 429 with
Retry-After through the official `openai` client, gRPC RESOURCE_EXHAUSTED with a
retry delay — while admitted requests complete; /metrics tells the story. With the
default caps, a flood past measured capacity is refused by the queue-time bound."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import re
import statistics
import time
import urllib.request

import grpc
import openai
import pytest

from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import sampling_pb2
from protos.pushback import PUSHBACK_KEY, RETRY_AFTER_KEY

from .conftest import start_server

pytestmark = pytest.mark.integration
CONCURRENCY = 6


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, model_dir):
    """One running sequence and one waiting request at most: the third is refused."""
    srv = start_server(tmp_path_factory.mktemp("overload"), model_dir,
                       "--kv-cache-bytes", str(96 << 20), "--max-num-seqs", "1",
                       "--max-num-batched-tokens", "256", "--chunk-size", "256",
                       "--max-num-waiting", "1")
    yield srv
    assert srv.stop() == 0


def _http_attempt(server) -> tuple[str, float, str | None]:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                           timeout=120)
    started = time.monotonic()
    try:
        client.completions.create(model="", prompt="Count to ten:", max_tokens=48,
                                  temperature=0, extra_body={"ignore_eos": True})
    except openai.RateLimitError as exc:
        return "429", time.monotonic() - started, exc.response.headers.get("retry-after")
    return "ok", time.monotonic() - started, None


def test_full_queue_is_429_with_retry_after_at_once(tiny_server):
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda _: _http_attempt(tiny_server), range(CONCURRENCY)))
    refused = [r for r in results if r[0] == "429"]
    served = [r for r in results if r[0] == "ok"]
    assert refused and served, results
    assert all(r[2] is not None and int(r[2]) >= 1 for r in refused)
    # Refused without waiting for a slot: faster than any served request finished.
    assert max(r[1] for r in refused) < min(r[1] for r in served)


def test_full_queue_is_resource_exhausted_over_grpc(tiny_server):
    request = gen.GenerateRequest(prompt="Count to ten:", max_tokens=48,
                                  sampling={"temperature": 0.0, "ignore_eos": True})

    def attempt(_):
        with grpc.insecure_channel(tiny_server.addr) as channel:
            call = tiny_server.generation_stub(channel).Generate(request, timeout=120)
            try:
                list(call)
            except grpc.RpcError as exc:
                return exc.code(), dict(exc.trailing_metadata() or ())
            return grpc.StatusCode.OK, {}

    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(attempt, range(CONCURRENCY)))
    codes = [code for code, _ in results]
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    for code, metadata in results:
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # gRFC A6's trailer, which gRPC's retry policy honours, and our older alias
            assert int(metadata[PUSHBACK_KEY]) > 0
            assert metadata[PUSHBACK_KEY] == metadata[RETRY_AFTER_KEY]


def test_metrics_count_what_happened(tiny_server):
    url = f"http://127.0.0.1:{tiny_server.http_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert re.search(r'^continuum_gateway_request_errors_total\{[^}]*code="RESOURCE_EXHAUSTED"',
                     text, re.M)
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert f"continuum_gateway_{name}{{" in text, name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total"):  # each replica's Stats, as the gateway read them
        assert f"continuum:{name}{{" in text, name


@pytest.fixture(scope="module")
def bounded_server(tmp_path_factory, model_dir):
    """Default queue caps; two slots and a 1 s queue-time bound for standard requests,
    so that ten times what fits is a small flood on any machine."""
    srv = start_server(tmp_path_factory.mktemp("flood"), model_dir,
                       "--kv-cache-bytes", str(96 << 20), "--max-num-seqs", "2",
                       "--max-queue-time-standard-s", "1")
    yield srv
    assert srv.stop() == 0


async def _attempt(stub, max_tokens: int, priority=gen.PRIORITY_STANDARD):
    """(code, seconds to the outcome, retry-after-ms or None, responses)."""
    request = gen.GenerateRequest(prompt="Count to ten:", max_tokens=max_tokens,
                                  priority=priority,
                                  sampling={"temperature": 0.0, "ignore_eos": True})
    started = time.monotonic()
    responses = []
    try:
        async for response in stub.Generate(request, timeout=300):
            responses.append(response)
    except grpc.aio.AioRpcError as exc:
        retry = dict(exc.trailing_metadata() or ()).get("retry-after-ms")
        return exc.code(), time.monotonic() - started, retry, responses
    return grpc.StatusCode.OK, time.monotonic() - started, None, responses


def test_a_flood_is_refused_at_once_from_measured_throughput(bounded_server):
    """Sustained load first (four best-effort clients on two slots: its 20 s bound lets
    them queue), so the scheduler measures what it serves; then ten times what fits in
    standard's 1 s bound at once: the excess gets RESOURCE_EXHAUSTED with a retry hint
    before any work, the rest completes."""

    async def scenario():
        async with grpc.aio.insecure_channel(bounded_server.addr) as channel:
            stub = bounded_server.generation_stub(channel)
            served = []
            began = time.monotonic()

            async def client():
                while len(served) < 12:
                    code, _, retry, _ = await _attempt(stub, 8, gen.PRIORITY_BEST_EFFORT)
                    if code == grpc.StatusCode.OK:
                        served.append(time.monotonic())
                    else:  # honour the hint, as a client should
                        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry
                        await asyncio.sleep(int(retry) / 1000)

            await asyncio.gather(*(client() for _ in range(4)))
            per_s = len(served) / (served[-1] - began)
            flood = max(40, math.ceil(10 * (per_s * 1.0 + 2)))
        # A connection each 50 streams: the gateway caps concurrent streams per
        # connection (grpc_max_concurrent_streams, 100), which is not what this tests.
        channels = [grpc.aio.insecure_channel(bounded_server.addr,
                                              options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(math.ceil(flood / 50))]
        try:
            stubs = [bounded_server.generation_stub(c) for c in channels]
            return await asyncio.gather(*(_attempt(stubs[i % len(stubs)], 16)
                                          for i in range(flood)))
        finally:
            for channel in channels:
                await channel.close()

    results = asyncio.run(scenario())
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = [r for r in results if r[0] == grpc.StatusCode.OK]
    assert len(refused) + len(served) == len(results), {r[0] for r in results}
    assert served and len(refused) > len(results) // 2
    for _, _, retry, responses in refused:
        assert int(retry) >= 1000 and not responses  # a hint; refused before any work
    for _, _, _, responses in served:
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 16
    # Refused at Submit, not after queueing: typically sooner than a served one ends.
    assert statistics.median(r[1] for r in refused) < statistics.median(r[1] for r in served)

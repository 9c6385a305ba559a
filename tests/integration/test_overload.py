"""Backpressure on the real stack: a full queue is refused at once — HTTP 429 with
Retry-After through the official `openai` client, gRPC RESOURCE_EXHAUSTED with a
retry delay — while admitted requests complete; /metrics tells the story."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.request

import grpc
import openai
import pytest

from protos.continuum.v1 import generation_pb2 as gen

from .conftest import start_server, stop_server

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
    assert stop_server(srv) == 0


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
            assert int(metadata["retry-after-ms"]) > 0


def test_metrics_count_what_happened(tiny_server):
    url = f"http://127.0.0.1:{tiny_server.http_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'continuum:request_errors_total{code="RESOURCE_EXHAUSTED"' in text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "prompt_tokens_total", "generation_tokens_total", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total"):
        assert f"continuum:{name}{{" in text, name

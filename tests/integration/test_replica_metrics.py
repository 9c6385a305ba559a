"""The replica's /metrics through real processes: scraped while a request runs, parsed
with Prometheus' parser, the gauges endpoint pickers read move with the load."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from continuum.serve.procs import free_port
from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc

from .conftest import start_server

pytestmark = pytest.mark.integration


def _scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_gauges_follow_a_running_request_and_histograms_count_it(tmp_path, model_dir):
    port = free_port()
    server = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(96 << 20),
                          "--metrics-port", str(port), "--telemetry-dsn", "off")
    try:
        # Ready means an executor registered: its pool is on the page before any request
        # (within a publish interval), never block_size 0 / num_gpu_blocks 0.
        deadline = time.monotonic() + 2.0
        while not (info := _scrape(port)["vllm:cache_config_info"]):
            assert time.monotonic() < deadline, "no vllm:cache_config_info once ready"
            time.sleep(0.02)
        labels = info[0].labels
        assert int(labels["block_size"]) > 0 and int(labels["num_gpu_blocks"]) > 0
        assert labels["model_name"] == server.stats().model_id
        warm = _scrape(port)
        assert warm["continuum:submit_many_streams"][0].value == 0  # no request yet
        ttft_before = {s.name: s.value for s in warm["vllm:time_to_first_token_seconds"]}
        request = gen.GenerateRequest(prompt="Count to fifty:", max_tokens=48,
                                      sampling={"temperature": 0.0, "ignore_eos": True})
        done = threading.Event()

        def run() -> None:
            with grpc.insecure_channel(server.addr) as channel:
                list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120))
            done.set()

        threading.Thread(target=run, daemon=True).start()
        running_seen = False
        while not done.is_set():
            samples = _scrape(port)
            running_seen |= samples["vllm:num_requests_running"][0].value == 1
            time.sleep(0.02)
        assert running_seen, "a running request never showed in vllm:num_requests_running"
        time.sleep(0.2)  # one publish interval after the stream ended
        after = _scrape(port)
        assert after["vllm:num_requests_running"][0].value == 0
        count = {s.name: s.value for s in after["vllm:time_to_first_token_seconds"]}
        name = "vllm:time_to_first_token_seconds_count"
        assert count[name] - ttft_before[name] == 1
        assert after["vllm:generation_tokens"][0].value - warm["vllm:generation_tokens"][
            0].value == 48
        # The gateway's first request came on its one SubmitMany call (there is no other
        # way: no fallback while its Stats poll is pending), which stays open.
        assert after["continuum:submit_many_streams"][0].value == 1
        assert after["continuum:submit_many_calls"][0].value == 1
        info = after["vllm:cache_config_info"][0].labels
        assert int(info["block_size"]) > 0 and int(info["num_gpu_blocks"]) > 0
    finally:
        assert server.stop() == 0

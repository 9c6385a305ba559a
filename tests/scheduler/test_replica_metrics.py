"""The replica's /metrics (scheduler_svc/metrics.py): vLLM's names, labels and buckets,
parsed with Prometheus' own text parser, served from the last published page by the
server process (scheduler_svc/metrics_server.py)."""

from __future__ import annotations

import errno
import http.client
import time
import types
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime import metric_names as names
from scheduler_svc.core import Scheduler, SchedulerConfig
from scheduler_svc.core.kv_events import KVEventLog
from scheduler_svc.executors import ExecutorInfo
from scheduler_svc.gc_pacing import GcPacer
from scheduler_svc.loop import Streams
from scheduler_svc.metrics import Histograms, MetricsServer, render
from scheduler_svc.plan_channel import PlanChannel
from tests.scheduler.factories import make_model, make_request

# What the GIE endpoint picker / llm-d and inference-perf read.
GIE_NAMES = {"vllm:num_requests_waiting", "vllm:num_requests_running",
             "vllm:kv_cache_usage_perc", "vllm:cache_config_info"}
PERF_NAMES = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:prompt_tokens",
              "vllm:generation_tokens", "vllm:num_preemptions", "vllm:prefix_cache_queries",
              "vllm:prefix_cache_hits", "vllm:request_success"}


def _loop(tmp_path) -> types.SimpleNamespace:
    """What render reads of an EngineLoop: its core, executor, recorder and plan channel (a
    real loop would open a ZeroMQ socket that a test must then close)."""
    core = Scheduler(SchedulerConfig(watermark=0.0))
    executor = ExecutorInfo("inc-1", "smollm2-q4", make_model(num_blocks=64, block_size=4), 1)
    core.attach_executor(executor.model)
    link = types.SimpleNamespace(plans=PlanChannel("zmq", "ipc:///unused", None))
    faults = types.SimpleNamespace(num_failed_steps=0, num_resyncs=0, num_row_failures=0)
    return types.SimpleNamespace(core=core, executor=executor, last_executor=executor,
                                 recorder=None, link=link, gc=GcPacer(), faults=faults,
                                 streams=Streams())


def _families(page: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(page.decode())}


def test_the_page_has_every_name_gateways_and_load_tools_read(tmp_path):
    loop = _loop(tmp_path)
    for i in range(3):
        loop.core.add_request(make_request(8, 4, request_id=f"w{i}",
                                           priority_tier=i % 3))
    hist = Histograms()
    req = make_request(8, 4, request_id="done")
    req.arrival_time, req.first_scheduled_time = 10.0, 10.5
    hist.request_ended(req, [11.0, 11.1, 11.3], 2)
    page = render(loop, hist, "smollm2")
    families = _families(page)
    assert GIE_NAMES | PERF_NAMES <= set(families)
    for line in (b"# TYPE vllm:num_requests_waiting gauge",  # what GIE pickers read, bytewise
                 b'vllm:num_requests_waiting{model_name="smollm2"} 3.0',
                 b'vllm:num_requests_running{model_name="smollm2"} 0.0',
                 b'vllm:kv_cache_usage_perc{model_name="smollm2"} 0.0',
                 b'vllm:cache_config_info{model_name="smollm2",block_size="4",'
                 b'num_gpu_blocks="64"} 1.0'):
        assert b"\n" + line + b"\n" in page, line
    value = {f.name: f.samples[0] for f in families.values() if f.samples}
    assert value["vllm:num_requests_waiting"].value == 3
    assert value["vllm:num_requests_waiting"].labels == {"model_name": "smollm2"}
    assert 0.0 <= value["vllm:kv_cache_usage_perc"].value <= 1.0
    info = value["vllm:cache_config_info"].labels
    assert info["block_size"] == "4" and info["num_gpu_blocks"] == "64"
    ttft = {s.name: s for s in families["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"].value == 1
    assert ttft["vllm:time_to_first_token_seconds_sum"].value == pytest.approx(1.0)
    itl = families["vllm:inter_token_latency_seconds"].samples
    assert [s.value for s in itl if s.name.endswith("_count")] == [2]
    assert families["vllm:generation_tokens"].samples[0].value == 3
    waiting = {s.labels["tier"]: s.value
               for s in families["continuum:num_requests_waiting_by_tier"].samples}
    assert waiting == {"premium": 1, "standard": 1, "best_effort": 1}


def test_the_page_exports_exactly_its_table(tmp_path):
    """Every family runtime/metric_names.py declares for the replica, of its type, and
    nothing else."""
    families = _families(render(_loop(tmp_path), Histograms(), "m"))
    assert {n: f.type for n, f in families.items()} == {f.name: f.kind for f in names.REPLICA}


def test_the_kv_configuration_is_never_an_empty_pool(tmp_path):
    """Before any executor registered the series is absent (an endpoint picker reading
    zeros would see an empty pool); while a replacement loads, the last pool stays."""
    loop = _loop(tmp_path)
    executor = loop.executor
    loop.core.detach_executor()
    loop.executor = loop.last_executor = None
    before = _families(render(loop, Histograms(), ""))
    assert before["vllm:cache_config_info"].samples == []
    loop.last_executor = executor  # it registered, then died: a replacement is loading
    (sample,) = _families(render(loop, Histograms(), ""))["vllm:cache_config_info"].samples
    assert sample.labels == {"model_name": "smollm2-q4", "block_size": "4",
                             "num_gpu_blocks": "64"}


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_the_server_answers_from_the_last_page_without_the_loop(tmp_path):
    server = MetricsServer("127.0.0.1", 0)
    server.start()
    try:
        server.page = render(_loop(tmp_path), Histograms(), "m")
        start = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            body, kind = r.read(), r.headers["Content-Type"]
        assert time.perf_counter() - start < 5
        assert kind.startswith("text/plain") and GIE_NAMES <= set(_families(body))
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
        assert missing.value.code == 404
    finally:
        server.stop()


def test_our_guards_are_counted_on_the_page(tmp_path):
    loop = _loop(tmp_path)
    loop.core.lifecycle.preemptions_by_reason["priority:recompute"] += 2
    loop.core.lifecycle.preemptions_by_reason["kv_full:swap"] += 1
    families = _families(render(loop, Histograms(), "m"))
    by_cause = {(s.labels["reason"], s.labels["kind"]): s.value
                for s in families["continuum:num_preemptions_by_reason"].samples}
    assert by_cause == {("priority", "recompute"): 2, ("kv_full", "swap"): 1}
    assert {"continuum:prefill_alert_steps", "continuum:swap_cap_fallbacks"} <= set(families)
    assert families["continuum:kv_events_dropped"].samples[0].value == 0  # no publisher
    loop.core.kv_events = KVEventLog()
    loop.core.kv_events.num_dropped = 3
    families = _families(render(loop, Histograms(), "m"))
    assert families["continuum:kv_events_dropped"].samples[0].value == 3
    loop.faults.num_row_failures, loop.core.lifecycle.num_recomputed_tokens = 2, 40
    families = _families(render(loop, Histograms(), "m"))
    assert families["continuum:row_failures"].samples[0].value == 2
    assert families["continuum:recomputed_tokens"].samples[0].value == 40
    assert families["continuum:resyncs"].samples[0].value == 0
    loop.link.plans.num_ring_plans, loop.link.plans.num_zmq_plans = 5, 2
    families = _families(render(loop, Histograms(), "m"))
    sent = {s.labels["channel"]: s.value for s in families["continuum:plans_sent"].samples}
    assert sent == {"shm": 5, "zmq": 2}
    loop.gc.collections, loop.gc.seconds = [7, 1, 0], 0.25
    families = _families(render(loop, Histograms(), "m"))
    by_generation = {s.labels["generation"]: s.value
                     for s in families["continuum:gc_collections"].samples}
    assert by_generation == {"0": 7, "1": 1, "2": 0}
    assert families["continuum:gc_seconds"].samples[0].value == 0.25


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_the_server_process_keeps_the_connection_and_serves_each_new_page_whole():
    server = MetricsServer("127.0.0.1", 0)
    try:
        with pytest.raises(OSError) as taken:  # a bind error surfaces in the parent
            MetricsServer("127.0.0.1", server.port)
        assert taken.value.errno == errno.EADDRINUSE and taken.value.strerror
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        for i in range(50):  # one kept-alive connection, as Prometheus and the EPP scrape
            server.page = f"# page {i}\n".encode() * (1 + i * 37)
            conn.request("GET", "/metrics")
            body = conn.getresponse().read()
            assert body == f"# page {i}\n".encode() * (1 + i * 37)  # never torn or stale
        conn.close()
    finally:
        server.stop()
    assert server._proc.returncode is not None  # the child is gone with the server

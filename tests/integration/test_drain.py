"""SIGTERM under load: in-flight requests finish, new ones get UNAVAILABLE,
every process exits within the grace period, none is orphaned."""

from __future__ import annotations

import concurrent.futures
import signal
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from protos.continuum.v1 import sampling_pb2
from tests.integration.conftest import processes_mentioning, start_server
from tests.integration.test_serve import chat, collect

pytestmark = pytest.mark.integration


def test_sigterm_drains_in_flight_work_and_refuses_new(tmp_path, model_dir):
    srv = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(96 << 20),
                       "--grace-period", "60")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(collect, srv, chat(f"Describe color {i}.", max_tokens=30,
                                                  ignore_eos=True)) for i in range(6)]
        while srv.stats().num_running < 6:
            time.sleep(0.05)
        signed_off = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(grpc.RpcError) as refused:
            collect(srv, chat("Too late?", max_tokens=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # HTTP: still listening, but readiness fails and new work gets 503 with a reason.
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as http_refused:
            client.completions.create(model="", prompt="Too late?", max_tokens=5)
        assert http_refused.value.status_code == 503
        assert "shutting down" in http_refused.value.body["message"]
        health = f"http://127.0.0.1:{srv.http_port}/health"
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(health, timeout=5)
        assert not_ready.value.code == 503
        results = [f.result(timeout=120) for f in futures]
    for responses in results:
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 30
    assert srv.proc.wait(timeout=60) == 0
    assert time.monotonic() - signed_off < 60
    time.sleep(0.5)
    assert processes_mentioning(srv.ipc) == []

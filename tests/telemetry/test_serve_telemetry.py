"""Telemetry through real processes: `continuum serve --telemetry-dsn` records what its
clients saw, and `continuum report` answers per tenant with their own figures
(SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import pytest

from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc
from tests.integration.conftest import start_server

pytestmark = pytest.mark.integration
TENANTS = {"acme": 3, "globex": 2}
MAX_TOKENS = {"acme": 6, "globex": 9}


def _stream(addr: str, tenant: str, i: int) -> tuple[float, int]:
    """One greedy gRPC stream; (client TTFT seconds, output tokens)."""
    request = gen.GenerateRequest(prompt=f"Say {i} words about {tenant}.", tenant=tenant,
                                  max_tokens=MAX_TOKENS[tenant], sampling={"temperature": 0.0},
                                  request_id=f"{tenant}-{i}")
    sampling = request.sampling
    sampling.ignore_eos = True
    with grpc.insecure_channel(addr) as channel:
        start = time.monotonic()
        ttft, tokens = None, 0
        for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            if response.token_ids and ttft is None:
                ttft = time.monotonic() - start
            tokens += len(response.token_ids)
    return ttft, tokens


def test_the_report_of_a_replayed_workload_matches_what_the_clients_saw(
        tmp_path, model_dir, store_target):
    server = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(96 << 20),
                          "--telemetry-dsn", store_target)
    seen: dict[str, list[tuple[float, int]]] = {t: [] for t in TENANTS}
    try:
        for tenant, count in TENANTS.items():
            for i in range(count):
                seen[tenant].append(_stream(server.addr, tenant, i))
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])  # flushes
    out = subprocess.run([sys.executable, "-m", "continuum", "report", "--store", store_target,
                          "--since", "1h", "--format", "json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for tenant, runs in seen.items():
        row = report["by_tenant"][tenant]
        assert row["num_requests"] == row["num_completed"] == len(runs)
        assert row["output_tokens"] == sum(tokens for _, tokens in runs)
        client_ttft_ms = sorted(ttft * 1e3 for ttft, _ in runs)
        # The scheduler's TTFT is the client's minus the gateway and network legs.
        assert 0 < row["ttft_p99_ms"] <= client_ttft_ms[-1] + 1.0
        assert 0 <= row["queue_wait_p99_ms"] <= row["ttft_p99_ms"]
        assert row["tpot_median_ms"] > 0
    assert report["steps"]["num_steps"] > 0
    assert report["by_tier"]["standard"]["num_requests"] == sum(TENANTS.values())

"""`continuum report` and `gate` find the store `continuum serve` wrote without being
told, resolved as serve resolves it (flag, then $CONTINUUM_TELEMETRY_DSN, then the
user's state directory), and say which store they read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from continuum.serve import local_state
from continuum.serve.config import telemetry_dsn
from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc
from tests.integration.conftest import start_server


def _continuum(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "continuum", *argv], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.mark.integration
def test_report_and_gate_read_what_serve_wrote_by_default(tmp_path, model_dir):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop(local_state.ENV_TELEMETRY_DSN, None)
    server = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(96 << 20), env=env)
    try:
        request = gen.GenerateRequest(prompt="Hello", max_tokens=4, tenant="acme")
        with grpc.insecure_channel(server.addr) as channel:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120))
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
    store = tmp_path / "state" / "continuum" / "telemetry.sqlite"
    out = _continuum(env, "report", "--since", "1h", "--format", "json")
    assert out.returncode == 0, out.stderr
    assert f"store {store} (continuum serve's default)" in out.stderr
    assert json.loads(out.stdout)["by_tenant"]["acme"]["num_requests"] == 1
    gate = _continuum(env, "gate", "--baseline-window", "1h..now", "--candidate-window",
                      "1h..now")
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert f"store {store} (continuum serve's default)" in gate.stderr
    elsewhere = {**env, "XDG_STATE_HOME": str(tmp_path / "nothing-here")}
    missing = _continuum(elsewhere, "report", "--since", "1h")
    assert missing.returncode == 2 and "no telemetry store at" in missing.stderr


def test_serve_and_the_readers_resolve_the_store_the_same_way(tmp_path):
    env = {"XDG_STATE_HOME": str(tmp_path), local_state.ENV_TELEMETRY_DSN: "/srv/t.sqlite"}
    assert local_state.telemetry_store(None, "--store", env) == (
        "/srv/t.sqlite", "$CONTINUUM_TELEMETRY_DSN")
    assert local_state.telemetry_store("x.sqlite", "--store", env) == ("x.sqlite", "--store")
    del env[local_state.ENV_TELEMETRY_DSN]
    assert local_state.telemetry_store(None, "--store", env) == (
        str(tmp_path / "continuum" / "telemetry.sqlite"), "continuum serve's default")
    os.environ[local_state.ENV_TELEMETRY_DSN] = "postgresql://u:pw@db/t"
    try:  # serve passes the same store on to its scheduler
        assert telemetry_dsn(None) == "postgresql://u:pw@db/t"
    finally:
        del os.environ[local_state.ENV_TELEMETRY_DSN]
    assert local_state.describe("postgresql://u:pw@db/t") == "postgresql://u:***@db/t"
    assert local_state.describe("postgresql://db/t") == "postgresql://db/t"

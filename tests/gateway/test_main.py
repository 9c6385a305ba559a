"""`python -m gateway` as a process: startup errors, JSON logs, SIGTERM drain."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .harness import free_port

pytestmark = pytest.mark.spawns  # starts service processes (tests/tiers.py)


def _gateway_cmd(model_dir, port, *extra):
    return [
        sys.executable,
        "-m",
        "gateway",
        "--model-dir",
        str(model_dir),
        "--scheduler",
        f"127.0.0.1:{free_port()}",
        "--port",
        str(port),
        "--http-port",
        "0",  # any free port: never collide with a server on the default 8000
        *extra,
    ]


def test_port_in_use_is_one_line_and_exit_2(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            _gateway_cmd(model_dir, port), capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 2
    assert done.stderr == f"gateway: port {port} is already in use; pass --port\n"


def test_model_dir_without_tokenizer_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run(_gateway_cmd(tmp_path, 0), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "has no tokenizer.json" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_and_exits_0(model_dir, sig):
    proc = subprocess.Popen(
        _gateway_cmd(model_dir, 0, "--grace-period", "1"), stderr=subprocess.PIPE, text=True
    )
    try:
        serving = json.loads(proc.stderr.readline())
        assert serving["event"] == "gateway serving" and serving["level"] == "info"
        with grpc.insecure_channel(f"127.0.0.1:{serving['port']}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
        events = [json.loads(line)["event"] for line in proc.stderr]
        # The replica poller may log between the two (there is no scheduler here).
        assert events[-1] == "gateway stopped"
        assert "draining" in events and events.index("draining") < len(events) - 1
    finally:
        if proc.poll() is None:
            proc.kill()

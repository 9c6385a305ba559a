"""A real ``python -m scheduler_svc`` process on loopback, without an executor."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from continuum.serve.procs import free_port
from tests.tiers import spawns_processes

START_TIMEOUT_S = 60


def scheduler_cmd(ipc_dir, port: int) -> list[str]:
    return [sys.executable, "-m", "scheduler_svc", "--ipc", f"ipc://{ipc_dir}/executor.sock",
            "--scheduler-port", str(port), "--grace-period", "0"]


def wait_serving(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                return
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the scheduler did not start"
                time.sleep(0.1)


@pytest.fixture(scope="module")
@spawns_processes
def scheduler_address(tmp_path_factory):
    """A scheduler process with the suite's secret; yields its address."""
    port = free_port()
    proc = subprocess.Popen(scheduler_cmd(tmp_path_factory.mktemp("sched"), port),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(port, proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def scheduler(scheduler_address):
    with grpc.insecure_channel(scheduler_address) as channel:
        yield channel

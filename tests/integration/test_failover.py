"""A gateway with two scheduler replicas: kill -9 one while it streams, and
every client stream completes through the other, without duplicates."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest

from protos.continuum.v1 import sampling_pb2
from tests.integration.conftest import Server, free_port, start_server, stop_server
from tests.integration.test_serve import chat, collect

pytestmark = pytest.mark.integration

QUESTIONS = [f"Tell me about planet number {i}." for i in range(6)]


def pid_of(module: str, marker: str) -> int:
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if module.encode() in cmd and marker.encode() in cmd:
                return int(entry.name)
    raise AssertionError(f"no {module} process with {marker}")


def run(server, questions):
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        runs = list(pool.map(
            lambda q: collect(server, chat(q, max_tokens=32, ignore_eos=True)), questions))
    for responses in runs:
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 32
    return [[t for r in responses for t in r.token_ids] for responses in runs]


def test_streams_continue_on_another_replica(tmp_path, model_dir):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    a = start_server(tmp_path / "a", model_dir)
    b = start_server(tmp_path / "b", model_dir)
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model-dir", str(model_dir), "--port", str(port),
         "--http-port", "0",
         "--scheduler", f"127.0.0.1:{a.scheduler_port},127.0.0.1:{b.scheduler_port}"],
        stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
        both = Server(gateway, port, 0, "", [])
        baseline = run(b, QUESTIONS)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            streams = pool.submit(run, both, QUESTIONS)
            deadline = time.monotonic() + 60
            while a.stats().num_running == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert a.stats().num_running > 0, "some streams should have gone to replica a"
            time.sleep(1.0)  # let them stream a few tokens through a
            os.kill(pid_of("scheduler_svc", a.ipc), signal.SIGKILL)
            tokens = streams.result(timeout=300)
        assert tokens == baseline
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
        a.proc.kill()
        a.proc.wait()
        stop_server(b)

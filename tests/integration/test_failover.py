"""A gateway with two scheduler replicas: kill -9 one while it streams, or SIGSTOP
it (a hung replica: its connections stay open), and every client stream completes
through the other, without a lost or duplicated token; with no other replica left,
a hung one's streams end UNAVAILABLE instead of hanging."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pathlib
import signal
import time

import grpc
import pytest

from harness import servers
from protos.continuum.v1 import sampling_pb2
from tests.integration.conftest import start_server
from tests.integration.test_serve import chat, collect

pytestmark = pytest.mark.integration

QUESTIONS = [f"Tell me about planet number {i}." for i in range(4)]
# Long enough that some are still streaming through a when it is seen running.
TOKENS = 64


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


def run(server, questions, max_tokens=32):
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        runs = list(pool.map(
            lambda q: collect(server, chat(q, max_tokens=max_tokens, ignore_eos=True)),
            questions))
    for responses in runs:
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == max_tokens
    return [[t for r in responses for t in r.token_ids] for responses in runs]


@contextlib.contextmanager
def two_replicas(tmp_path, model_dir):
    """(a, b, a gateway in front of both); every process is stopped on the way out."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    a = start_server(tmp_path / "a", model_dir)
    b = start_server(tmp_path / "b", model_dir)
    gateway = None
    try:
        gateway = servers.start_gateway([a.scheduler_port, b.scheduler_port], model_dir)
        yield a, b, gateway
    finally:
        if gateway is not None:
            gateway.proc.terminate()
            gateway.proc.wait(timeout=30)
        a.proc.kill()
        a.proc.wait()
        b.stop()


def test_streams_of_a_hung_replica_continue_on_another(tmp_path, model_dir):
    """SIGSTOP one of two schedulers mid-stream: the gateway's keepalive and progress
    watchdog give it up, and every stream ends through the other with the tokens of
    a reference run; a stream whose gateway knows only the hung replica gets
    UNAVAILABLE, not a hang."""
    with two_replicas(tmp_path, model_dir) as (a, b, both):
        baseline = run(b, QUESTIONS, max_tokens=TOKENS)

        def alone():  # through a's own gateway, whose only replica is a; never finishes
            try:
                collect(a, chat("Tell me a long story.", max_tokens=3000, ignore_eos=True))
            except grpc.RpcError as exc:
                return exc.code(), exc.details()
            return grpc.StatusCode.OK, ""

        hung = pid_of("scheduler_svc", a.ipc)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            lone = pool.submit(alone)
            streams = pool.submit(run, both, QUESTIONS, TOKENS)
            deadline = time.monotonic() + 120
            while a.stats().num_running < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert a.stats().num_running >= 2, "streams of both gateways should run on a"
            os.kill(hung, signal.SIGSTOP)
            try:
                tokens = streams.result(timeout=240)
                code, details = lone.result(timeout=240)
            finally:
                os.kill(hung, signal.SIGCONT)
        assert tokens == baseline  # nothing lost, nothing twice
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "stopped responding" in details or "reachable" in details


def test_streams_continue_on_another_replica(tmp_path, model_dir):
    with two_replicas(tmp_path, model_dir) as (a, b, both):
        baseline = run(b, QUESTIONS, max_tokens=TOKENS)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            streams = pool.submit(run, both, QUESTIONS, TOKENS)
            deadline = time.monotonic() + 60
            while a.stats().num_running == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert a.stats().num_running > 0, "some streams should have gone to replica a"
            os.kill(pid_of("scheduler_svc", a.ipc), signal.SIGKILL)
            tokens = streams.result(timeout=300)
        assert tokens == baseline

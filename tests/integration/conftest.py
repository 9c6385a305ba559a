"""Start the real three-process server (``continuum serve``) on free loopback ports."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from continuum.procs import free_port
from protos.continuum.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import TEST_METADATA
from tests.tiers import spawns_processes

READY_TIMEOUT_S = 240
# Servers this test may have used (started in it, or still running): a failing test's
# report shows their logs.
_started: list[Server] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        if report.failed:
            for srv in _started:
                report.sections.append((f"continuum serve (port {srv.port}) stderr",
                                        "".join(srv.stderr_lines[-80:])))
        _started[:] = [srv for srv in _started if srv.proc.poll() is None]


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (to prove nothing was orphaned)."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    port: int
    scheduler_port: int
    ipc: str
    stderr_lines: list[str]
    http_port: int = 0

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API's base URL (what `openai.OpenAI(base_url=...)` takes)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def generation_stub(self, channel: grpc.Channel):
        return generation_pb2_grpc.GenerationStub(channel)

    def stats(self) -> scheduler_pb2.StatsResponse:
        with grpc.insecure_channel(f"127.0.0.1:{self.scheduler_port}") as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            return stub.Stats(scheduler_pb2.StatsRequest(), timeout=5, metadata=TEST_METADATA)


def start_server(tmp: pathlib.Path, model_dir: pathlib.Path, *extra: str,
                 env: dict[str, str] | None = None) -> Server:
    """``env``: serve's environment (default: the suite's, with its internal secret)."""
    port, sched_port, http_port = free_port(), free_port(), free_port()
    ipc = f"ipc://{tmp}/executor.sock"
    cmd = [sys.executable, "-m", "continuum", "serve", "--model", str(model_dir),
           "--port", str(port), "--scheduler-port", str(sched_port), "--ipc", ipc,
           "--http-port", str(http_port),
           *(extra or ("--kv-cache-bytes", str(96 << 20)))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    ready = threading.Event()
    threading.Thread(target=lambda: ready.set() if proc.stdout.readline() else None,
                     daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not become ready:\n" + "".join(lines[-40:]))
    srv = Server(proc, port, sched_port, ipc, lines, http_port)
    _started.append(srv)
    return srv


def stop_server(server: Server) -> int:
    server.proc.send_signal(signal.SIGINT)
    try:
        return server.proc.wait(timeout=30)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


@pytest.fixture(scope="module")
@spawns_processes
def server(tmp_path_factory, model_dir):
    srv = start_server(tmp_path_factory.mktemp("serve"), model_dir)
    yield srv
    code = stop_server(srv)
    assert code == 0, "".join(srv.stderr_lines[-30:])
    deadline = time.monotonic() + 10  # children exit just after serve: wait, do not guess
    while processes_mentioning(srv.ipc) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_mentioning(srv.ipc) == [], "a child process outlived `continuum serve`"

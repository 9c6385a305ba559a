"""Start the real three-process server (``continuum serve``) on free loopback ports
(harness/servers.py); a failing test's report shows the logs of the servers it used."""

from __future__ import annotations

import os
import pathlib
import time

import pytest

from harness import servers
from harness.servers import Serve
from tests.tiers import spawns_processes

# Servers this test may have used (started in it, or still running): a failing test's
# report shows their logs.
_started: list[Serve] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        if report.failed:
            for srv in _started:
                report.sections.append((f"continuum serve (port {srv.port}) stderr",
                                        "".join(srv.log[-80:])))
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


def start_server(tmp: pathlib.Path, model_dir: pathlib.Path, *extra: str,
                 env: dict[str, str] | None = None) -> Serve:
    """``servers.start_serve`` as a test's: a server that does not start fails the test,
    and one that does is in the failure report. ``env``: default the suite's, with its
    internal secret."""
    try:
        srv = servers.start_serve(tmp, *extra, model=model_dir, env=env)
    except servers.ServerError as exc:
        pytest.fail(str(exc))
    _started.append(srv)
    return srv


@pytest.fixture(scope="module")
@spawns_processes
def server(tmp_path_factory, model_dir):
    srv = start_server(tmp_path_factory.mktemp("serve"), model_dir)
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])
    deadline = time.monotonic() + 10  # children exit just after serve: wait, do not guess
    while processes_mentioning(srv.ipc) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_mentioning(srv.ipc) == [], "a child process outlived `continuum serve`"

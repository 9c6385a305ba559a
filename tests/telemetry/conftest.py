"""Fixtures: every telemetry test runs on SQLite and on a real PostgreSQL server.

``pg_cluster`` starts one throwaway cluster per session (initdb in a temp dir, run
as an unprivileged user since PostgreSQL refuses root, listening on 127.0.0.1 on
a free port and a unix socket in the temp dir), and stops it at the end. Each
test gets a fresh database in it. The PostgreSQL variant skips, saying why, only
where no server binary exists.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest

from continuum.serve.procs import free_port
from telemetry import TelemetryStore

_PG_BIN_DIRS = sorted(pathlib.Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
_counter = itertools.count()


def _pg_bin() -> pathlib.Path | None:
    for d in _PG_BIN_DIRS:
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    found = shutil.which("initdb")
    return pathlib.Path(found).parent if found else None


def _as_user(cmd: list[str]) -> list[str]:
    # PostgreSQL will not run as root; drop to nobody where we are root.
    if os.geteuid() == 0:
        return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *cmd]
    return cmd


@pytest.fixture(scope="session")
def pg_cluster():
    """DSN prefix (``postgresql://postgres@127.0.0.1:PORT``) of a running throwaway cluster."""
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binary (initdb/pg_ctl) on this machine")
    root = pathlib.Path(tempfile.mkdtemp(prefix="continuum-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        root.chmod(0o755)
        shutil.chown(root, "nobody", "nogroup")
        shutil.chown(sock, "nobody", "nogroup")
    port = free_port()
    env = {**os.environ, "LC_ALL": "C"}
    subprocess.run(_as_user([str(bindir / "initdb"), "-D", str(data), "-U", "postgres",
                             "--auth=trust", "--no-sync", "-E", "UTF8"]),
                   check=True, capture_output=True, env=env)
    opts = (f"-c listen_addresses=127.0.0.1 -p {port} -k {sock} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off")
    subprocess.run(_as_user([str(bindir / "pg_ctl"), "-D", str(data), "-o", opts,
                             "-l", str(root / "log"), "-w", "-t", "60", "start"]),
                   check=True, capture_output=True, env=env)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(_as_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate",
                                 "stop"]), capture_output=True, env=env)
        shutil.rmtree(root, ignore_errors=True)


def fresh_pg_database(prefix: str) -> str:
    import psycopg

    name = f"t{os.getpid()}_{next(_counter)}"
    with psycopg.connect(f"{prefix}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{prefix}/{name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_target(request, tmp_path) -> str:
    """Where a fresh, empty store goes: a file path or a DSN of a new database."""
    if request.param == "sqlite":
        return str(tmp_path / "telemetry.db")
    return fresh_pg_database(request.getfixturevalue("pg_cluster"))


@pytest.fixture
def store(store_target):
    with TelemetryStore.open(store_target) as s:
        yield s

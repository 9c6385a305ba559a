"""`continuum config` against a `continuum serve` that generated its own internal secret
(none configured, as `make run` does): the same user needs nothing, serve keeps the
secret in a 0600 file of the user's state directory while it runs, and removes it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from continuum.serve import local_state
from runtime import internal_auth

from .conftest import start_server

pytestmark = pytest.mark.integration


def test_config_get_reaches_a_serve_whose_secret_it_was_never_given(tmp_path, model_dir):
    env = {k: v for k, v in os.environ.items()
           if k not in (internal_auth.ENV_SECRET, internal_auth.ENV_SECRET_FILE)}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    server = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(96 << 20),
                          "--telemetry-dsn", "off", env=env)
    secret = local_state.secret_file(server.scheduler_port, env)
    try:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
        out = subprocess.run(
            [sys.executable, "-m", "continuum", "config", "get", "--format", "json",
             "--scheduler", f"127.0.0.1:{server.scheduler_port}"],
            capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["values"]["max_num_seqs"]
        other_port = subprocess.run(  # another scheduler's secret is not this one's
            [sys.executable, "-m", "continuum", "config", "get",
             "--scheduler", f"127.0.0.1:{server.scheduler_port + 1}"],
            capture_output=True, text=True, timeout=60, env=env)
        assert other_port.returncode == 2 and "no internal secret" in other_port.stderr
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
    assert not secret.exists()

"""`continuum serve` fails with one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from continuum.serve.procs import free_port

pytestmark = pytest.mark.integration


def serve(*args: str) -> subprocess.CompletedProcess:
    # No HTTP port: a server on the default 8000 must not change which error is reported.
    return subprocess.run([sys.executable, "-m", "continuum", "serve", "--http-port", "-1", *args],
                          capture_output=True, text=True, timeout=120)


def test_missing_model_path_is_one_clear_error(tmp_path):
    out = serve("--model", str(tmp_path / "nope"), "--port", str(free_port()),
                "--scheduler-port", str(free_port()))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert str(tmp_path / "nope") in out.stderr


def test_malformed_model_file_is_one_clear_error(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"this is not a gguf file")
    out = serve("--model", str(bogus), "--port", str(free_port()),
                "--scheduler-port", str(free_port()))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr


def test_port_in_use_is_one_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = serve("--port", str(port), "--scheduler-port", str(free_port()))
    assert out.returncode == 2
    assert f"port {port}" in out.stderr and "already in use" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (("--gpu-memory-utilization", "0"), "--gpu-memory-utilization must be > 0 and <= 1"),
    (("--device", "gpu"), "--device must be auto, cpu, cuda or cuda:N"),
    (("--kv-cache-bytes", "lots"), "not a byte size: 'lots'"),
])
def test_bad_executor_flags_are_refused_before_anything_starts(flags, message):
    out = serve(*flags, "--port", str(free_port()), "--scheduler-port", str(free_port()))
    assert out.returncode == 2
    assert message in out.stderr
    assert "loading model" not in out.stderr and "Traceback" not in out.stderr

"""Shared fixtures. Factories here need no model or network; the model fixture
converts the bundled GGUF once per machine (cached under CONTINUUM_CACHE_DIR).

Every service refuses to start without the internal secret, so the suite sets a
fixed one at import time: every process a test starts (scheduler, gateway,
executor, ``continuum serve``) inherits it, and a test calling the scheduler
directly sends ``internal_auth.metadata(TEST_SECRET)``. A test that needs no
secret (or another) passes its own ``env``.

A test still running after twice its timeout (``hang_s``) is ended with every thread's
traceback, and the run exits 1. pytest-timeout's own limit (pyproject.toml) raises in
Python, which cannot happen while the main thread is blocked inside C (a zmq term(), a
lock): this turns such a hang into a red run that names its test, minutes in, not a CI
job that runs out its time."""

from __future__ import annotations

import faulthandler
import os
import pathlib
import sys
import tempfile

import pytest

from protos import internal_auth

TEST_SECRET = "continuum-test-internal-secret-0123456789"
os.environ[internal_auth.ENV_SECRET] = TEST_SECRET
os.environ.pop(internal_auth.ENV_SECRET_FILE, None)
os.environ.pop(internal_auth.ENV_INSECURE, None)
TEST_METADATA = internal_auth.metadata(TEST_SECRET.encode("ascii"))
# `continuum serve` records telemetry under $XDG_STATE_HOME by default: the suite's
# servers write to a directory of this run, never to the user's own store.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="continuum-test-state-")

HANG_FACTOR = 2  # a test is ended at twice its pytest-timeout limit
_hang_report: dict[str, int] = {}


def pytest_configure(config):
    # The terminal's stderr, duplicated while capture is off: during a test, fd 2 is
    # pytest's capture file, which an exiting process never shows.
    _hang_report["fd"] = os.dup(sys.stderr.fileno())


def hang_s(item) -> float | None:
    """When ``item`` is ended: HANG_FACTOR x its own timeout mark, else the ini's (None:
    no timeout, so no guard either)."""
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
    limit = float(limit or 0)
    return HANG_FACTOR * limit if limit > 0 else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = hang_s(item)
    if limit is not None:
        faulthandler.dump_traceback_later(limit, exit=True, file=_hang_report["fd"])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    """HF-format directory of the bundled SmolLM2-135M-Instruct (converted from GGUF once),
    or of ``$CONTINUUM_TEST_MODEL`` (a .gguf or HF directory): scripts/gpu_check.sh points
    it at a smaller copy where the whole model cannot be carried."""
    from executor_svc.model_files import resolve_model
    from executor_svc.settings import Switches  # $CONTINUUM_CACHE_DIR, as the executor's

    return resolve_model(os.environ.get("CONTINUUM_TEST_MODEL") or None,
                         Switches.from_env().cache_dir)

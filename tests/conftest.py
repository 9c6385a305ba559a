"""Shared fixtures. Factories here need no model or network; the model fixture
converts the bundled GGUF once per machine (cached under CONTINUUM_CACHE_DIR).

Every service refuses to start without the internal secret, so the suite sets a
fixed one at import time: every process a test starts (scheduler, gateway,
executor, ``continuum serve``) inherits it, and a test calling the scheduler
directly sends ``internal_auth.metadata(TEST_SECRET)``. A test that needs no
secret (or another) passes its own ``env``."""

from __future__ import annotations

import os
import pathlib
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


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    """HF-format directory of the bundled SmolLM2-135M-Instruct (converted from GGUF once),
    or of ``$CONTINUUM_TEST_MODEL`` (a .gguf or HF directory): scripts/gpu_check.sh points
    it at a smaller copy where the whole model cannot be carried."""
    from executor_svc.model_files import resolve_model
    from executor_svc.settings import Switches  # $CONTINUUM_CACHE_DIR, as the executor's

    return resolve_model(os.environ.get("CONTINUUM_TEST_MODEL") or None,
                         Switches.from_env().cache_dir)

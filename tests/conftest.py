"""Shared fixtures. Factories here need no model or network; the model fixture
converts the bundled GGUF once per machine (cached under CONTINUUM_CACHE_DIR)."""

from __future__ import annotations

import os
import pathlib

import pytest


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    """HF-format directory of the bundled SmolLM2-135M-Instruct (converted from GGUF once),
    or of ``$CONTINUUM_TEST_MODEL`` (a .gguf or HF directory): scripts/gpu_check.sh points
    it at a smaller copy where the whole model cannot be carried."""
    from executor_svc.model_files import resolve_model

    return resolve_model(os.environ.get("CONTINUUM_TEST_MODEL") or None)

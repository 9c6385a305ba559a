"""The attention backend choice: flash-attn > triton > torch on CUDA, the CPU unchanged, and
a backend that cannot run on the device refused at start with a message naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import BACKEND_NAMES, CUDA_ONLY_BACKENDS, backend_for, gpu_default
from kernels.flash_attn_backend import importable as flash_attn_importable

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_default_prefers_flash_attn_then_triton_then_torch():
    assert gpu_default(flash_attn=True, triton=True) == "flash-attn"
    assert gpu_default(flash_attn=True, triton=False) == "flash-attn"
    assert gpu_default(flash_attn=False, triton=True) == "triton"
    assert gpu_default(flash_attn=False, triton=False) == "torch"


def test_cpu_choice_is_unchanged_and_every_name_is_a_flag_choice():
    assert backend_for(None, "cpu") == "numba"
    assert set(CUDA_ONLY_BACKENDS) <= set(BACKEND_NAMES)


def test_cuda_only_backends_are_refused_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="(runs on CUDA only|needs the triton package)"):
        backend_for("triton", "cpu")
    if not flash_attn_importable():  # this project's CPU machines: no flash-attn build
        with pytest.raises(ValueError, match="needs the flash-attn package"):
            backend_for("flash-attn", "cpu")


def test_executor_refuses_triton_on_the_cpu_before_loading_a_model():
    env = {**os.environ, "CONTINUUM_INSECURE_NO_INTERNAL_AUTH": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-m", "executor_svc", "--attention-backend", "triton",
         "--ipc", "ipc:///tmp/continuum-test-triton-choice.sock"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--attention-backend triton" in done.stderr
    assert "loading model" not in done.stderr

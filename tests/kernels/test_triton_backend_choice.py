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


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
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


def test_flash_attn_hands_what_it_cannot_take_to_its_fallback(caplog):
    # flash-attn cannot be built here; the hand-off decisions are made before it is called.
    import torch

    from kernels.attention import AttentionMetadata
    from kernels.flash_attn_backend import FlashAttnBackend
    from kernels.reference import ReferenceAttentionBackend
    from kernels.torch_backend import TorchAttentionBackend

    def never(*args, **kwargs):
        raise AssertionError("flash-attn was asked for a step it cannot take")

    backend = FlashAttnBackend(fallback=TorchAttentionBackend(), varlen_func=never)
    gen = torch.Generator().manual_seed(0)
    for block_size, dtype in [(16, torch.float16), (256, torch.float32)]:
        meta = AttentionMetadata.build([1, 3], [5, 3], [[1], [0]], block_size)
        cache = [torch.randn(2, block_size, 2, 16, generator=gen).to(dtype) for _ in range(2)]
        q = torch.randn(4, 4, 16, generator=gen).to(dtype)
        # This step's K/V rows: seq 0's position 4 (block 1), seq 1's positions 0-2 (block 0).
        k, v = (torch.cat([c[1, 4:5], c[0, :3]]) for c in cache)
        got = backend.forward(q, k, v, *cache, backend.prepare(meta), 0.25)
        want = ReferenceAttentionBackend().forward(q, None, None, *cache, meta, 0.25)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
    assert "--block-size 16 is no multiple of 256" in caplog.text
    assert "torch.float32" in caplog.text  # the dtype reason, said once
    assert caplog.text.count("--block-size 16") == 1

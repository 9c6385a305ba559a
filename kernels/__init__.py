"""Attention backends behind one interface (kernels/attention.py).

``numba``: decode rows read K/V blocks in place through a compiled kernel, chunks through
SDPA (the CPU default; float32, other dtypes fall back to ``torch``; CPU tensors only).
``torch``: SDPA over gathered blocks, any device (the default on a GPU). ``reference``: slow
and obviously correct, for tests. Triton / flash-attn backends plug in here once a GPU
needs them.
"""

from __future__ import annotations

import torch

BACKEND_NAMES = ("numba", "torch", "reference")
DEFAULT_BACKEND = "numba"  # on the CPU; on other devices, "torch" (see backend_for)
CPU_ONLY_BACKENDS = ("numba",)


def backend_for(name: str | None, device="cpu") -> str:
    """``--attention-backend`` checked against the device: None picks the device's default
    (the in-place kernel on the CPU, SDPA elsewhere); a CPU-only backend on another device
    is a ValueError, at start-up rather than on every step."""
    device = torch.device(device)
    if name is None:
        return DEFAULT_BACKEND if device.type == "cpu" else "torch"
    if name in CPU_ONLY_BACKENDS and device.type != "cpu":
        raise ValueError(f"--attention-backend {name} runs on the CPU only; use "
                         f"--attention-backend torch with --device {device.type}")
    return name


def make_backend(name: str | None = DEFAULT_BACKEND, device="cpu", native_options=None):
    """An AttentionBackend by name (checked by ``backend_for``) for tensors on ``device``;
    imports only the one asked for. ``numba`` compiles its kernel here (or loads it from
    numba's on-disk cache), not on the first request, and loads the AVX2 kernel as
    ``native_options`` say (kernels/native.py; None: the defaults)."""
    name = backend_for(name, device)
    if name == "numba":
        from kernels.numba_backend import NumbaAttentionBackend

        return NumbaAttentionBackend(native_options=native_options)
    if name == "torch":
        from kernels.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "reference":
        from kernels.reference import ReferenceAttentionBackend

        return ReferenceAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")

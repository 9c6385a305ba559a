"""Attention backends behind one interface (kernels/attention.py).

``numba``: decode rows read K/V blocks in place through a compiled kernel, chunks through
SDPA (the CPU default; float32, other dtypes fall back to ``torch``; CPU tensors only).
``torch``: SDPA over gathered blocks, any device. ``triton``: Triton kernels reading the
blocks in place (CUDA; kernels/triton_attention.py). ``flash-attn``: flash-attn's varlen
kernel over the block table, falling back to triton/torch for what it cannot take
(kernels/flash_attn_backend.py). ``reference``: slow and obviously correct, for tests.

On a GPU the default is the first that can run: flash-attn > triton > torch, logged once
by ``make_backend``; ``--attention-backend`` overrides it.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

BACKEND_NAMES = ("numba", "torch", "triton", "flash-attn", "reference")
DEFAULT_BACKEND = "numba"  # on the CPU; on other devices, see gpu_default
CPU_ONLY_BACKENDS = ("numba",)
CUDA_ONLY_BACKENDS = ("triton", "flash-attn")  # triton also under TRITON_INTERPRET (tests)


def gpu_default(flash_attn: bool, triton: bool) -> str:
    """The GPU default given what is importable: flash-attn, else triton, else torch."""
    return "flash-attn" if flash_attn else "triton" if triton else "torch"


def _importable() -> tuple[bool, bool]:
    from kernels import flash_attn_backend, triton_attention

    return flash_attn_backend.importable(), triton_attention.triton_installed()


def backend_for(name: str | None, device="cpu") -> str:
    """``--attention-backend`` checked against the device: None picks the device's default
    (the in-place kernel on the CPU, ``gpu_default`` on CUDA, SDPA elsewhere); a backend
    that cannot run there is a ValueError, at start-up rather than on every step."""
    device = torch.device(device)
    if name is None:
        if device.type == "cpu":
            return DEFAULT_BACKEND
        return gpu_default(*_importable()) if device.type == "cuda" else "torch"
    if name in CPU_ONLY_BACKENDS and device.type != "cpu":
        raise ValueError(f"--attention-backend {name} runs on the CPU only; use "
                         f"--attention-backend torch with --device {device.type}")
    if name in CUDA_ONLY_BACKENDS:
        from kernels import triton_attention

        flash, triton = _importable()
        if not (flash if name == "flash-attn" else triton):
            raise ValueError(f"--attention-backend {name} needs the {name} package "
                             "(pip install 'continuum[gpu]' on a CUDA machine)")
        if not (device.type == "cuda" or (name == "triton" and triton_attention.available(device))):
            raise ValueError(f"--attention-backend {name} runs on CUDA only; the default "
                             f"for --device {device.type} needs no flag")
    return name


def make_backend(name: str | None = DEFAULT_BACKEND, device="cpu", native_options=None):
    """An AttentionBackend by name (checked by ``backend_for``) for tensors on ``device``;
    imports only the one asked for. ``numba`` compiles its kernel here (or loads it from
    numba's on-disk cache), not on the first request, and loads the AVX2 kernel as
    ``native_options`` say (kernels/native.py; None: the defaults)."""
    chosen = backend_for(name, device)
    if torch.device(device).type != "cpu":
        log.info("attention backend: %s (%s)", chosen,
                 "--attention-backend" if name else "flash-attn > triton > torch, the first "
                 "importable")
    return _build(chosen, native_options)


def _build(name: str, native_options):
    if name == "numba":
        from kernels.numba_backend import NumbaAttentionBackend

        return NumbaAttentionBackend(native_options=native_options)
    if name == "torch":
        from kernels.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash-attn":
        from kernels.flash_attn_backend import FlashAttnBackend
        from kernels.triton_attention import triton_installed

        return FlashAttnBackend(fallback=_build("triton" if triton_installed() else "torch",
                                                None))
    if name == "reference":
        from kernels.reference import ReferenceAttentionBackend

        return ReferenceAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")

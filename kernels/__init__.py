"""Attention backends behind one interface (kernels/attention.py).

``torch``: SDPA over gathered blocks, any device (the CPU default). ``reference``: slow and
obviously correct, for tests. Triton / flash-attn backends plug in here once a GPU needs them.
"""

from __future__ import annotations

BACKEND_NAMES = ("torch", "reference")


def make_backend(name: str = "torch"):
    """An AttentionBackend by name; imports only the one asked for."""
    if name == "torch":
        from kernels.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "reference":
        from kernels.reference import ReferenceAttentionBackend

        return ReferenceAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")

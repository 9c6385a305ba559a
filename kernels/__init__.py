"""Attention backends behind one interface (kernels/attention.py).

``numba``: decode rows read K/V blocks in place through a compiled kernel, chunks through
SDPA (the CPU default; float32, other dtypes fall back to ``torch``). ``torch``: SDPA over
gathered blocks, any device. ``reference``: slow and obviously correct, for tests. Triton /
flash-attn backends plug in here once a GPU needs them.
"""

from __future__ import annotations

BACKEND_NAMES = ("numba", "torch", "reference")
DEFAULT_BACKEND = "numba"


def make_backend(name: str = DEFAULT_BACKEND):
    """An AttentionBackend by name; imports only the one asked for. ``numba`` compiles its
    kernel here (or loads it from numba's on-disk cache), not on the first request."""
    if name == "numba":
        from kernels.numba_backend import NumbaAttentionBackend

        return NumbaAttentionBackend()
    if name == "torch":
        from kernels.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "reference":
        from kernels.reference import ReferenceAttentionBackend

        return ReferenceAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")

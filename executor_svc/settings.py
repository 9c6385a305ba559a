"""The executor's environment switches: read here, once, and nowhere else.

``executor_svc/__main__.py`` reads them into its frozen ExecutorConfig at start (and the
other entry points that load a model the same way, e.g. ``python -m executor_svc.model_files``
and benchmarks/bench_executor.py, call the same ``Switches.from_env``); every component gets
the values it needs as keyword arguments whose defaults are "nothing set", so tests and
benchmarks that build a model, a KV cache or a backend directly need no environment.

Imports neither torch nor the kernels (``model_files``' command line, which ``continuum
serve`` runs at every start, reads ``cache_dir`` here in milliseconds).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from executor_svc.faults import ENV_FAULT_INJECT, FaultInjector
from executor_svc.flags import WEIGHT_FORMATS

if TYPE_CHECKING:
    from kernels.native import NativeOptions


@dataclass(frozen=True, kw_only=True)
class Switches:
    """Every environment variable the executor reads, with the field it lands in.

    ========================== ================ ==============================================
    variable                   field            meaning (unset: the default)
    ========================== ================ ==============================================
    CONTINUUM_NATIVE_KERNELS   native_kernels   ``0``: no C++ library (kernels/native.py):
                                                numba attention, MKL matmuls, torch KV writes
    CONTINUUM_KERNEL_CACHE     kernel_cache     directory tried first for the built library
                                                (then kernels/__pycache__/, then the temp dir)
    CXX                        compiler         the compiler that builds it (g++, else c++)
    CONTINUUM_NATIVE_GEMM      native_gemm      ``0``: projections through MKL, weights not
                                                packed for the native GEMM (and no decoder)
    CONTINUUM_NATIVE_DECODER   native_decoder   ``0``: decode steps layer by layer from
                                                Python instead of one native call
    CONTINUUM_WEIGHT_FORMAT    weight_format    auto (hybrid or native for a GGUF where the
                                                native GEMM runs, else fp32), native (the
                                                GGUF's own blocks), hybrid (blocks plus an
                                                fp32 copy for wide GEMMs), fp32 or bf16:
                                                weight_formats.py (the flag wins)
    CONTINUUM_CPU_ISA          cpu_isa          auto (the highest the CPU has), avx2 or
                                                avx512: which native library build loads
    CONTINUUM_CACHE_DIR        cache_dir        where GGUF conversions go (``<dir>/models``;
                                                default ``~/.cache/continuum``)
    CONTINUUM_FAULT_INJECT     faults           test-only fault injection (faults.py)
    ========================== ================ ==============================================

    The internal secret (``CONTINUUM_INTERNAL_SECRET`` / ``_FILE``, or the opt-out
    ``CONTINUUM_INSECURE_NO_INTERNAL_AUTH=1``) is read by runtime/internal_auth.py, which the
    scheduler shares; ``NUMBA_*`` variables are numba's own. The native switches apply
    where the library does: float32 on an AVX2 CPU.
    """

    native_kernels: bool = True
    kernel_cache: str | None = None
    compiler: str | None = None
    native_gemm: bool = True
    native_decoder: bool = True
    weight_format: str = "auto"
    cpu_isa: str = "auto"
    cache_dir: str | None = None
    faults: FaultInjector = field(default_factory=FaultInjector)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ,
                 weight_format: str | None = None) -> Switches:
        """Raises ValueError (naming the variable) for a value that cannot be meant.
        ``weight_format``: the ``--weight-format`` flag, which wins over the variable."""

        def on(name: str) -> bool:  # as before: anything but "0" leaves a switch on
            return environ.get(name, "1") != "0"

        def choice(name: str, allowed: tuple[str, ...]) -> str:
            value = environ.get(name) or "auto"
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
            return value

        return cls(
            weight_format=weight_format or choice("CONTINUUM_WEIGHT_FORMAT", WEIGHT_FORMATS),
            cpu_isa=choice("CONTINUUM_CPU_ISA", ("auto", "avx2", "avx512")),
            native_kernels=on("CONTINUUM_NATIVE_KERNELS"),
            kernel_cache=environ.get("CONTINUUM_KERNEL_CACHE") or None,
            compiler=environ.get("CXX") or None,
            native_gemm=on("CONTINUUM_NATIVE_GEMM"),
            native_decoder=on("CONTINUUM_NATIVE_DECODER"),
            cache_dir=environ.get("CONTINUUM_CACHE_DIR") or None,
            faults=FaultInjector.parse(environ.get(ENV_FAULT_INJECT, "")),
        )

    def native_options(self) -> NativeOptions:
        """The library switches in the form kernels/native.py's ``load`` takes."""
        # Imported here, not above: kernels.native loads torch and numba (~3 s), which the
        # torch-free readers of this module (model_files' command line) must not pay.
        from kernels.native import NativeOptions

        return NativeOptions(enabled=self.native_kernels, cache_dir=self.kernel_cache,
                             compiler=self.compiler, isa=self.cpu_isa)

    def model_options(self) -> dict:
        """DecoderModel's keyword arguments for these switches."""
        return {"native_options": self.native_options(), "native_gemm": self.native_gemm,
                "native_decoder": self.native_decoder, "weight_format": self.weight_format}

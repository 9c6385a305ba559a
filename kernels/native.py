"""Builds and loads the AVX2 kernels through ctypes: kernels/cpu_attention.cpp (paged decode
attention over float32 / float16 / bfloat16 pools, full or sliding-window),
kernels/cpu_ops.cpp (fused residual add + RMSNorm, RoPE + q/k/v layout, KV write, SwiGLU),
kernels/cpu_gemm.cpp (small-batch GEMM over pre-packed weights) and kernels/cpu_decoder.cpp
(a step's decoder layers in one call, driven by kernels/native_decoder.py), one library.

Plain C++ with no torch headers: built once per source version (~8 s) into
``kernels/__pycache__/`` (or ``NativeOptions.cache_dir``, or a temp dir); later processes
load it in milliseconds. ``load()`` returns None (the numba kernel stays in use) when the
CPU lacks AVX2/FMA/F16C, there is no compiler, the build fails or ``NativeOptions.enabled``
is False; it never raises. No environment is read here (executor_svc/settings.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

import kernels.numba_kernels  # noqa: F401  (promotes torch's libgomp first: one OpenMP pool)

log = logging.getLogger(__name__)

SOURCES = tuple(pathlib.Path(__file__).with_name(n)
                for n in ("cpu_attention.cpp", "cpu_ops.cpp", "cpu_gemm.cpp", "cpu_decoder.cpp"))
# cpu_qgemm.cpp is compiled on its own with -ffp-contract=off (its dequantized weights must
# round as numpy's separate multiply and add do), then linked with the others.
QGEMM_SOURCE = pathlib.Path(__file__).with_name("cpu_qgemm.cpp")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# One library per instruction-set level, from the same sources: the AVX-512 build compiles
# the `#ifdef __AVX512F__` paths (cpu_qgemm.cpp's 16-lane accumulation) and lets the compiler
# use 512-bit vectors elsewhere. Not BF16 / VNNI: their dot products take bf16 / int8
# activations, and the activations here stay fp32 (token-exact against transformers).
ISA_FLAGS = {"avx2": (), "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")}
ISA_CPU_FLAGS = {"avx2": {"avx2", "fma", "f16c"},
                 "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}
# Pool element types the kernels read and write (cpu_attention.cpp's `kind`).
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@dataclass(frozen=True, kw_only=True)
class NativeOptions:
    """Whether and how ``load`` builds the library; the defaults are every switch unset."""

    enabled: bool = True  # False: no library, the numba kernel and torch's ops instead
    cache_dir: str | None = None  # tried before kernels/__pycache__/ and the temp directory
    compiler: str | None = None  # None: g++, else c++, from PATH
    isa: str = "auto"  # auto: the highest ISA_FLAGS level the CPU has; or force one


class NativeKernels:
    """The loaded library; ``paged_decode`` has numba_kernels.paged_decode's arguments."""

    def __init__(self, lib: ctypes.CDLL, path: pathlib.Path, isa: str = "avx2") -> None:
        self.lib, self.path, self.isa = lib, path, isa  # lib: kernels/quant.py binds its own
        self._supports = lib.paged_decode_supports
        self._supports.argtypes, self._supports.restype = [_I64], ctypes.c_int
        self._decode = lib.paged_decode_kv
        self._decode.argtypes = [_PTR] * 5 + [_I64, _PTR] + [_I64] * 5 + [
            ctypes.c_float, _PTR, ctypes.c_int, ctypes.c_int, _I64]
        self._decode.restype = None
        self._norm = lib.add_rms_norm_f32
        self._norm.argtypes = [_PTR] * 4 + [_I64, _I64, ctypes.c_float]
        self._norm.restype = None
        self._rope_qkv = lib.rope_qkv_f32
        self._rope_qkv.argtypes, self._rope_qkv.restype = [_PTR] * 6 + [_I64] * 4, None
        self._kv_write = lib.kv_write_kv
        self._kv_write.argtypes = [_PTR] * 5 + [_I64] * 3 + [ctypes.c_int]
        self._kv_write.restype = _I64
        self._gemm_floats = lib.gemm_packed_floats
        self._gemm_floats.argtypes, self._gemm_floats.restype = [_I64, _I64], _I64
        self._gemm_pack = lib.gemm_pack_weight_f32
        self._gemm_pack.argtypes, self._gemm_pack.restype = [_PTR, _PTR, _I64, _I64], None
        self._gemm = lib.gemm_packed_f32
        self._gemm.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64,
                               ctypes.c_int]
        self._gemm.restype = None
        self._silu_mul = lib.silu_mul_f32
        self._silu_mul.argtypes, self._silu_mul.restype = [_PTR] * 3 + [_I64, ctypes.c_int], None
        self._fma_peak = lib.fma_peak_gflops
        self._fma_peak.argtypes, self._fma_peak.restype = [_I64, ctypes.c_int], ctypes.c_double
        self._decode_layers = lib.decode_layers_f32
        self._decode_layers.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR]
        self._decode_layers.restype = _I64

    def supports(self, head_dim: int) -> bool:
        return bool(self._supports(head_dim))

    def paged_decode(self, q: np.ndarray, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: np.ndarray, tables: np.ndarray, context_lens: np.ndarray,
                     scale: float, out: np.ndarray, threads: int, window: int = 0) -> None:
        # q, out [T, Hq, D] float32 C-contiguous; the pools [N, block, Hkv, D] contiguous
        # CPU tensors of a KV_KINDS dtype; rows, context_lens [B] and tables [B, nb] int64
        # C-contiguous (the caller guarantees it: a wrong stride here reads the wrong memory,
        # not a Python error). window: a sliding window (kernels/attention.py), 0 for full;
        # the blocks before a row's window are not read.
        assert rows.dtype == tables.dtype == context_lens.dtype == np.int64
        assert tables.flags.c_contiguous and q.flags.c_contiguous and out.flags.c_contiguous
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert k_cache.dtype == v_cache.dtype
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        self._decode(q.ctypes.data, k_cache.data_ptr(), v_cache.data_ptr(),
                     rows.ctypes.data, tables.ctypes.data, tables.shape[1],
                     context_lens.ctypes.data, rows.shape[0], q.shape[1], num_kv_heads, block_size,
                     head_dim, scale, out.ctypes.data, threads, KV_KINDS[k_cache.dtype], window)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += delta (in place, if given); returns RMSNorm(x) * w over dim 0. x, delta
        [H, T] and w [H] float32 contiguous CPU tensors."""
        assert x.dtype == w.dtype == torch.float32 and x.is_contiguous() and w.is_contiguous()
        assert delta is None or (delta.is_contiguous() and delta.shape == x.shape)
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), None if delta is None else delta.data_ptr(), w.data_ptr(),
                   out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 num_heads: int, num_kv_heads: int):
        """qkv [(Hq + 2 Hkv) D, T] hidden-major, cos / sin [D, T] -> q [T, Hq, D], k and v
        [T, Hkv, D], token-major, RoPE applied to q and k (model.apply_rope's values).
        float32 contiguous CPU tensors; D a multiple of 8 (``supports``)."""
        dim, tokens = cos.shape
        assert qkv.dtype == cos.dtype == sin.dtype == torch.float32 and dim % 8 == 0
        assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        assert qkv.shape == ((num_heads + 2 * num_kv_heads) * dim, tokens)
        q = torch.empty(tokens, num_heads, dim)
        k = torch.empty(tokens, num_kv_heads, dim)
        v = torch.empty(tokens, num_kv_heads, dim)
        self._rope_qkv(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                       k.data_ptr(), v.data_ptr(), num_heads, num_kv_heads, dim, tokens)
        return q, k, v

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, slots: torch.Tensor) -> None:
        """k_pool.view(-1, Hkv, D)[slots[t]] = k[t], the same for v: k, v [T, Hkv, D] float32
        and the pools [N, block, Hkv, D] of a KV_KINDS dtype (rounded as torch's .to()),
        contiguous, slots [T] int64 (IndexError outside the pool, and nothing written)."""
        assert k.dtype == v.dtype == torch.float32 and k_pool.dtype == v_pool.dtype
        assert all(t.is_contiguous() for t in (k, v, k_pool, v_pool, slots))
        assert slots.dtype == torch.int64 and k.shape == v.shape and k.shape[0] == slots.shape[0]
        row = k[0].numel() if k.shape[0] else 0
        num_slots = k_pool.shape[0] * k_pool.shape[1]
        bad = self._kv_write(k.data_ptr(), v.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                             slots.data_ptr(), k.shape[0], row, num_slots,
                             KV_KINDS[k_pool.dtype])
        if bad:
            raise IndexError(f"{bad} KV slots outside the pool's {num_slots}")

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up (torch's SiLU to ~2 ulp), one pass; float32 contiguous CPU tensors
        of one shape."""
        assert gate.dtype == up.dtype == torch.float32 and gate.shape == up.shape
        assert gate.is_contiguous() and up.is_contiguous()
        out = torch.empty_like(gate)
        self._silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(),
                       torch.get_num_threads())
        return out

    def pack_weight(self, w: torch.Tensor) -> PackedWeight:
        """w [M, K] float32 CPU -> the GEMM's panel layout (cpu_gemm.cpp); w is not kept."""
        assert w.dtype == torch.float32 and w.dim() == 2 and w.device.type == "cpu"
        w = w.contiguous()
        data = torch.empty(self._gemm_floats(*w.shape), dtype=torch.float32)
        self._gemm_pack(w.data_ptr(), data.data_ptr(), *w.shape)
        return PackedWeight(self, data, (w.shape[0], w.shape[1]))

    def decode_layers(self, layers: int, num_layers: int, shape: int, step: int, x: int,
                      phases: int | None) -> int:
        """cpu_decoder.cpp's decode_layers_f32 on addresses (kernels/native_decoder.py's)."""
        return self._decode_layers(layers, num_layers, shape, step, x, phases)

    def fma_peak_gflops(self, threads: int, rounds: int = 20_000_000) -> float:
        """GFLOP/s of ``threads`` threads issuing register-only FMAs (cpu_gemm.cpp's
        fma_peak_gflops: the compute ceiling no GEMM can pass), ~0.05 s a call."""
        return self._fma_peak(rounds, threads)

    def gemm(self, packed: PackedWeight, x: torch.Tensor, out: torch.Tensor, ldc_m: int,
             ldc_n: int) -> None:
        """out[m * ldc_m + n * ldc_n] = (W @ x)[m, n] for W packed in ``packed``; x [K, N]
        float32 CPU, any strides; ``out`` float32 with room for every (m, n)."""
        m, k = packed.shape
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] != k or x.device.type != "cpu":
            raise ValueError(f"expected float32 CPU x [{k}, N], got {x.dtype} {tuple(x.shape)}")
        if x.shape[1]:
            self._gemm(packed.data.data_ptr(), m, k, x.data_ptr(), x.stride(0), x.stride(1),
                       x.shape[1], out.data_ptr(), ldc_m, ldc_n, torch.get_num_threads())


class PackedWeight:
    """A weight [M, K] in cpu_gemm.cpp's panel layout (``NativeKernels.pack_weight``).
    ``mm(x)`` = w @ x like ``torch.Tensor.mm``, so a layer calls ``w.mm(x)`` whichever kind
    of weight it holds."""

    def __init__(self, lib: NativeKernels, data: torch.Tensor, shape: tuple[int, int]) -> None:
        self._lib, self.data, self.shape = lib, data, shape
        self.dtype, self.device = data.dtype, data.device

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [K, N] (any strides, e.g. a transposed token-major tensor) -> [M, N]."""
        out = torch.empty(self.shape[0], x.shape[1], dtype=torch.float32)
        self._lib.gemm(self, x, out, out.stride(0), 1)
        return out

    def mm_t(self, x: torch.Tensor) -> torch.Tensor:
        """x [K, N] -> (w @ x).T = [N, M], written token-major (the LM head's logits)."""
        out = torch.empty(x.shape[1], self.shape[0], dtype=torch.float32)
        self._lib.gemm(self, x, out, 1, out.stride(0))
        return out


def cpu_flags() -> set[str]:
    """The first CPU's flags in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text().split("\nflags", 2)[1].split("\n")[0]
    except (OSError, IndexError):
        return set()
    return set(flags.split(":", 1)[-1].split())


def _cpu_has_avx2_fma() -> bool:
    return ISA_CPU_FLAGS["avx2"] <= cpu_flags()


def choose_isa(requested: str, flags: set[str]) -> str | None:
    """The ISA_FLAGS level to load: ``requested`` ("auto": the highest the CPU has), never one
    the CPU lacks (a forced avx512 on an AVX2 CPU falls back, logged); None below AVX2
    (AVX2, FMA and F16C: every AVX2 CPU has all three)."""
    have = [isa for isa, need in ISA_CPU_FLAGS.items() if need <= flags]
    if not have:
        return None
    if requested not in ("auto", *ISA_FLAGS):
        raise ValueError(f"unknown ISA {requested!r}: expected auto, {', '.join(ISA_FLAGS)}")
    if requested != "auto" and requested not in have:
        log.warning("native kernels: %s requested but the CPU lacks it; using %s",
                    requested, have[-1])
    return requested if requested in have else have[-1]


def _cache_dirs(first: str | None) -> list[pathlib.Path]:
    return [*([pathlib.Path(first)] if first else []), SOURCES[0].parent / "__pycache__",
            pathlib.Path(tempfile.gettempdir()) / "continuum-kernels"]


def _build(target: pathlib.Path, compiler: str, isa: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = (*FLAGS, *ISA_FLAGS[isa])
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # then rename: atomic
    os.close(fd)
    obj = tmp + ".qgemm.o"
    try:
        subprocess.run([compiler, *flags, "-ffp-contract=off", "-c", str(QGEMM_SOURCE), "-o",
                        obj], check=True, capture_output=True, text=True, timeout=600)
        subprocess.run([compiler, *flags, *map(str, SOURCES), obj, "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=600)
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)


def library_name(isa: str) -> str:
    """The cached library's file name: keyed on the sources, the flags and torch."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, QGEMM_SOURCE))
                         + " ".join((*FLAGS, *ISA_FLAGS[isa])).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    return f"cpu_attention-{isa}-{key}.so"


def build(isa: str, options: NativeOptions | None = None) -> pathlib.Path:
    """Builds (or finds cached) the ``isa`` library without loading it, so a CPU without that
    ISA can still check that it compiles. Raises CalledProcessError / OSError."""
    options = options or NativeOptions()
    compiler = options.compiler or shutil.which("g++") or shutil.which("c++") or "g++"
    path = _cache_dirs(options.cache_dir)[0] / library_name(isa)
    if not path.exists():
        _build(path, compiler, isa)
    return path


def compile_check(isa: str, out_dir: pathlib.Path, compiler: str = "g++") -> pathlib.Path:
    """Compiles cpu_qgemm.cpp (where the ISA-specific paths are) with ``isa``'s flags into
    an object in ``out_dir``: a CPU without the ISA can still check that its build compiles
    (seconds, not the whole library's build). Raises CalledProcessError."""
    obj = out_dir / f"cpu_qgemm-{isa}.o"
    subprocess.run([compiler, *FLAGS, *ISA_FLAGS[isa], "-ffp-contract=off", "-c",
                    str(QGEMM_SOURCE), "-o", str(obj)], check=True, capture_output=True,
                   text=True, timeout=600)
    return obj


def load(options: NativeOptions | None = None) -> NativeKernels | None:
    """The compiled kernels (building them if no cached copy exists), or None. ``options``:
    None for the defaults (no switch set). The ISA level is chosen here, once per process
    and library, and logged."""
    options = options or NativeOptions()
    isa = choose_isa(options.isa, cpu_flags()) if options.enabled else None
    if isa is None:
        return None
    compiler = options.compiler or shutil.which("g++") or shutil.which("c++")
    name = library_name(isa)
    for directory in _cache_dirs(options.cache_dir):
        path = directory / name
        try:
            if not path.exists():
                if compiler is None:
                    return None
                _build(path, compiler, isa)
            kernels = NativeKernels(ctypes.CDLL(str(path)), path, isa)
            if (isa, options.isa) not in _LOGGED:
                _LOGGED.add((isa, options.isa))
                log.info("native kernels: the %s build (requested %s; CPU has avx512f: %s)",
                         isa, options.isa, "avx512f" in cpu_flags())
            return kernels
        except subprocess.CalledProcessError as e:
            log.warning("native attention kernel did not build (numba kernel in use): %s",
                        e.stderr[-2000:])
            return None
        except (OSError, subprocess.TimeoutExpired) as e:
            log.info("native attention kernel: %s unusable (%s), trying the next", path, e)
    return None


_LOGGED: set[tuple[str, str]] = set()

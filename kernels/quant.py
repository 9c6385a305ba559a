"""Weights kept in their GGUF block formats, multiplied by kernels/cpu_qgemm.cpp (in the
library kernels/native.py builds): ``QuantWeight`` is a projection [M, K] made of row segments
(``RawTensor``s: a GGUF tensor's raw rows of blocks, or fp32), with ``mm`` / ``mm_t`` like
native.PackedWeight so a layer calls ``w.mm(x)`` whichever kind of weight it holds, and
``rows(ids)`` for an embedding lookup. Every value the kernels use equals
``gguf.quants.dequantize`` of the same bytes (tests/kernels/test_qgemm.py).
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from kernels.native import NativeKernels, PackedWeight

# ggml type id -> (name, values per block, bytes per block). F32 is packed for cpu_gemm.cpp.
FORMATS = {0: ("F32", 1, 4), 1: ("F16", 32, 64), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
           8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210),
           30: ("BF16", 32, 64)}
BF16 = 30
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class RawTensor:
    """One weight's rows as stored: ``data`` uint8 [rows, row_bytes] of ``format`` blocks
    (a ggml type id in FORMATS), or float32 [rows, cols] for F32 (format 0)."""

    format: int
    shape: tuple[int, int]
    data: np.ndarray

    def take_rows(self, order: np.ndarray) -> RawTensor:
        """The rows in ``order`` (blocks never straddle rows: a row permutation is exact)."""
        return RawTensor(self.format, self.shape, np.ascontiguousarray(self.data[order]))

    @staticmethod
    def bf16(w: torch.Tensor) -> RawTensor:
        """w [M, K] float32 rounded to bfloat16 (torch's round-to-nearest-even, as ggml's)."""
        bits = w.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        return RawTensor(BF16, (w.shape[0], w.shape[1]), bits.view(np.uint8))


def readable(t: RawTensor) -> bool:
    """Whether cpu_qgemm.cpp reads ``t`` natively: a known format whose rows are whole blocks
    (and, for the 32-value kernels, a multiple of 32 values)."""
    if t.format not in FORMATS:
        return False
    _, block, size = FORMATS[t.format]
    cols = t.shape[1]
    return t.format == 0 or (cols % max(block, 32) == 0 and t.data.shape[1] == cols // block * size)


# cpu_qgemm.cpp's kNarrow: GEMMs of up to this many columns read the blocks in one pass.
NARROW_MAX_COLUMNS = 8


class _QWeight(ctypes.Structure):  # cpu_qgemm.cpp's QWeight
    pass


_QWeight._fields_ = [("format", ctypes.c_int32), ("rows", _I64), ("cols", _I64),
                     ("row_bytes", _I64), ("data", _PTR), ("next", ctypes.POINTER(_QWeight)),
                     ("wide", ctypes.POINTER(_QWeight))]


def _bind(lib: NativeKernels):
    if not hasattr(lib, "_qgemm"):
        gemm, rows = lib.lib.qweight_gemm, lib.lib.qweight_rows
        gemm.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, ctypes.c_int]
        gemm.restype = None
        rows.argtypes, rows.restype = [_PTR, _PTR, _I64, _PTR], _I64
        lib._qgemm, lib._qrows = gemm, rows
    return lib


def chain_of(w: QuantWeight | PackedWeight) -> QuantWeight:
    """The QWeight chain cpu_decoder.cpp takes for either kind of projection: a PackedWeight
    becomes one fp32 segment over its panels (no copy; gemm_packed_f32 as before)."""
    if isinstance(w, QuantWeight):
        return w
    chain = QuantWeight.__new__(QuantWeight)
    chain._lib, chain._keep = w._lib, [w.data]
    chain._chain = (_QWeight * 1)()
    seg = chain._chain[0]
    seg.format, (seg.rows, seg.cols), seg.row_bytes = 0, w.shape, 0
    seg.data = w.data.data_ptr()
    chain.shape, chain.formats, chain.nbytes = w.shape, ("F32",), w.numel() * 4
    chain.dtype, chain.device = torch.float32, torch.device("cpu")
    return chain


def _merge(parts: list[RawTensor]) -> list[RawTensor]:
    """Neighbouring parts in one block format as one segment (rows of blocks concatenate):
    q/k/v of one format become one GEMM call, one parallel region and one X packing."""
    out: list[RawTensor] = []
    for p in parts:
        if out and out[-1].format == p.format != 0:
            last = out.pop()
            p = RawTensor(p.format, (last.shape[0] + p.shape[0], p.shape[1]),
                          np.concatenate([last.data, p.data]))
        out.append(p)
    return out


class QuantWeight:
    """A weight [M, K]: ``parts`` stacked by rows (q, k, v; gate, up), each in its own
    format. Holds its bytes (torch uint8 / float32 tensors) and the segment chain."""

    _wide: QuantWeight | None = None  # add_wide_copy's (chain_of builds without __init__)

    def __init__(self, lib: NativeKernels, parts: list[RawTensor]) -> None:
        cols = {p.shape[1] for p in parts}
        if len(cols) != 1 or not all(readable(p) for p in parts):
            raise ValueError(f"not one [M, K] weight in readable formats: "
                             f"{[(FORMATS.get(p.format, p.format), p.shape) for p in parts]}")
        self._lib = _bind(lib)
        self._keep: list = []
        parts = _merge(parts)
        self._chain = (_QWeight * len(parts))()
        for i, part in enumerate(parts):
            if part.format == 0:  # fp32: cpu_gemm.cpp's panels, via gemm_packed_f32
                packed = lib.pack_weight(torch.from_numpy(np.ascontiguousarray(part.data)))
                data, row_bytes = packed.data, 0
            else:  # read in place: a GGUF memmap's pages stay shared with the page cache
                with warnings.catch_warnings():  # read-only memmap: never written here
                    warnings.simplefilter("ignore", UserWarning)
                    data = torch.from_numpy(np.ascontiguousarray(part.data))
                row_bytes = data.shape[1]
            self._keep.append(data)
            seg = self._chain[i]
            seg.format, seg.rows, seg.cols = part.format, part.shape[0], part.shape[1]
            seg.row_bytes, seg.data = row_bytes, data.data_ptr()
            if i + 1 < len(parts):
                seg.next = ctypes.pointer(self._chain[i + 1])
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.formats = tuple(FORMATS[p.format][0] for p in parts)
        # What a step streams for this weight (bench_executor.py's roofline).
        self.nbytes = sum(p.shape[0] * p.shape[1] * 4 if p.format == 0 else p.data.nbytes
                          for p in parts)
        self.dtype, self.device = torch.float32, torch.device("cpu")

    @property
    def address(self) -> int:
        """The first segment's QWeight, as cpu_decoder.cpp's DecoderLayer takes it."""
        return ctypes.addressof(self._chain)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def _gemm(self, x: torch.Tensor, out: torch.Tensor, ldc_m: int, ldc_n: int) -> None:
        m, k = self.shape
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] != k or x.device.type != "cpu":
            raise ValueError(f"expected float32 CPU x [{k}, N], got {x.dtype} {tuple(x.shape)}")
        if x.shape[1]:
            self._lib._qgemm(self.address, x.data_ptr(), x.stride(0), x.stride(1), x.shape[1],
                             out.data_ptr(), ldc_m, ldc_n, torch.get_num_threads())

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [K, N] (any strides) -> w @ x, [M, N]."""
        out = torch.empty(self.shape[0], x.shape[1], dtype=torch.float32)
        self._gemm(x, out, out.stride(0), 1)
        return out

    def mm_t(self, x: torch.Tensor) -> torch.Tensor:
        """x [K, N] -> (w @ x).T = [N, M], written token-major (the LM head's logits)."""
        out = torch.empty(x.shape[1], self.shape[0], dtype=torch.float32)
        self._gemm(x, out, 1, out.stride(0))
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` [T] int64, [T, K] (an embedding lookup); IndexError
        for an id outside [0, M), as indexing a tensor raises."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.shape[1], dtype=torch.float32)
        if "F32" in self.formats:
            raise ValueError("rows() reads GGUF blocks only; this weight has fp32 segments")
        if self._lib._qrows(self.address, ids.data_ptr(), ids.shape[0], out.data_ptr()):
            raise IndexError(f"token ids outside the vocabulary [0, {self.shape[0]})")
        return out

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 [M, K] (tests; a fallback path)."""
        return self.rows(torch.arange(self.shape[0]))

    @property
    def wide_nbytes(self) -> int:
        """Bytes of the fp32 copy ``add_wide_copy`` holds (0 without one)."""
        return self._wide.nbytes if self._wide is not None else 0

    def add_wide_copy(self) -> bool:
        """Holds the weight dequantized and packed for cpu_gemm.cpp too (4 bytes a weight),
        which GEMMs of more than NARROW_MAX_COLUMNS columns then read instead of the
        blocks: the same sums in the same order, so the same bits (tests/kernels/
        test_qgemm.py), without a panel's dequantization per 128 columns (the ``hybrid``
        weight format). False, and nothing held, for a weight with fp32 segments (those
        are packed fp32 already)."""
        if "F32" in self.formats:
            return False
        if self._wide is None:
            dense = self.dequantize()
            self._wide = chain_of(self._lib.pack_weight(dense))
            self._chain[0].wide = ctypes.pointer(self._wide._chain[0])
        return True

"""A step's decoder layers in one native call (kernels/cpu_decoder.cpp, in the library that
kernels/native.py builds and loads): the ctypes structures that call takes and the
``NativeDecoder`` that fills them."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kernels import (
    quant,
    torch_backend,  # chunk_attention looked up per call (tests patch it)
)
from kernels.attention import check_window
from kernels.native import KV_KINDS, NativeKernels

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class _Layer(ctypes.Structure):  # cpu_decoder.cpp's DecoderLayer
    _fields_ = [(n, _PTR) for n in ("attn_norm", "wqkv", "wo", "ffn_norm", "w13", "w2")] + [
        ("window", _I64)]


class _Shape(ctypes.Structure):  # DecoderShape
    _fields_ = [(n, _I64) for n in ("hidden", "inter", "num_heads", "num_kv_heads", "head_dim")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):  # DecodeStep
    _fields_ = [("tokens", _I64), ("cos", _PTR), ("sin", _PTR), ("slots", _PTR), ("pool", _PTR),
                ("num_blocks", _I64), ("block_size", _I64), ("kind", ctypes.c_int),
                ("rows", _PTR), ("tables", _PTR), ("table_stride", _I64),
                ("context_lens", _PTR), ("num_seqs", _I64), ("attention_threads", ctypes.c_int),
                ("threads", ctypes.c_int), ("chunks", _PTR)] + [(n, _PTR) for n in "qkvo"]


_CHUNK_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)  # ChunkAttentionFn


class NativeDecoder:
    """Every decoder layer of a step in one call (kernels/cpu_decoder.cpp): the same
    kernels, in the same order, as the per-op forward in executor_svc/models/decoder.py,
    so the same values; without its ~12 Python and torch calls per layer, each of which
    starts with cold caches after the layer's GEMM and attention have streamed through them.
    A step's prefill chunks still take torch's SDPA (``kernels.torch_backend.chunk_attention``,
    called back once per layer for all of them).

    ``layers``: (attn_norm, wqkv, wo, ffn_norm, w13, w2) per layer, the norms float32 [H]
    tensors, the projections PackedWeights or quant.QuantWeights (GGUF blocks). Holds
    references to all of them. ``windows``: each layer's sliding window (kernels/attention.py;
    0 or None: full attention), for its decode rows (the native kernel) and its chunks alike;
    None: every layer full.

    ``phase_seconds``: None, or a float64 array of len(PHASES) to which each call adds the
    seconds spent in each phase (the bench's breakdown; ~20 ns per phase and layer).
    """

    PHASES = ("norms + residual", "layer matmuls", "rope + q/k/v layout", "KV write",
              "attention", "SwiGLU")

    def __init__(self, lib: NativeKernels, layers: list[tuple], hidden: int, inter: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 scale: float, windows=None) -> None:
        windows = [check_window(w) for w in (windows or [0] * len(layers))]
        if len(windows) != len(layers):
            raise ValueError(f"{len(windows)} windows for {len(layers)} layers")
        self.windows = tuple(windows)
        self._lib = lib
        self._keep = layers
        self._layers = (_Layer * len(layers))()
        self._chains = []  # the projections' QWeight chains (kernels/quant.py), kept alive
        for entry, parts, window in zip(self._layers, layers, windows, strict=True):
            entry.window = window
            ptrs = []
            for p in parts:
                if isinstance(p, torch.Tensor):  # a norm
                    ptrs.append(p.data_ptr())
                else:
                    self._chains.append(quant.chain_of(p))
                    ptrs.append(self._chains[-1].address)
            for (name, _), ptr in zip(_Layer._fields_[:-1], ptrs, strict=True):  # not window
                setattr(entry, name, ptr)
        self._shape = _Shape(hidden, inter, num_heads, num_kv_heads, head_dim, eps, scale)
        self._scale = scale  # SDPA's, unrounded: the per-op path passes the same float
        self.num_layers = len(layers)
        self.phase_seconds: np.ndarray | None = None

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, pool: torch.Tensor, rows: np.ndarray, tables: np.ndarray,
                 context_lens: np.ndarray, attention_threads: int, chunks=()) -> None:
        """x [H, T] (the embeddings) -> the residual stream after the last layer, in place.
        cos / sin [D, T] float32, slots [T] int64, pool [layers, 2, N, block, Hkv, D] of a
        KV_KINDS dtype, all contiguous CPU tensors. The attention plan is
        kernels/numba_backend.py's: rows, context_lens [B] and tables [B, nb] int64
        C-contiguous arrays for the B sequences that decode one token, and ``chunks``
        (torch_backend ChunkPlans) for the others' query rows. IndexError for a slot
        outside the pool; an error in a chunk's attention is raised as it was."""
        tokens = x.shape[1]
        shape = self._shape
        assert x.dtype == cos.dtype == sin.dtype == torch.float32 and slots.dtype == torch.int64
        assert all(t.is_contiguous() for t in (x, cos, sin, slots, pool))
        assert pool.dim() == 6 and pool.shape[0] == self.num_layers and pool.shape[1] == 2
        assert pool.shape[4:] == (shape.num_kv_heads, shape.head_dim)
        assert slots.shape == (tokens,) and rows.shape == context_lens.shape == (len(rows),)
        assert rows.dtype == tables.dtype == context_lens.dtype == np.int64
        assert tables.flags.c_contiguous and tables.shape[0] == len(rows)
        assert len(rows) + sum(c.end - c.start for c in chunks) == tokens
        q = torch.empty(tokens, shape.num_heads, shape.head_dim)
        k = torch.empty(tokens, shape.num_kv_heads, shape.head_dim)
        v = torch.empty(tokens, shape.num_kv_heads, shape.head_dim)
        o = torch.empty(tokens, shape.num_heads, shape.head_dim)
        errors: list[BaseException] = []
        callback = (_CHUNK_FN(self._chunk_attention(chunks, q, k, v, o, pool, errors))
                    if chunks else None)
        step = _Step(tokens, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), pool.data_ptr(),
                     pool.shape[2], pool.shape[3], KV_KINDS[pool.dtype], rows.ctypes.data,
                     tables.ctypes.data, tables.shape[1], context_lens.ctypes.data, len(rows),
                     attention_threads, torch.get_num_threads(),
                     None if callback is None else ctypes.cast(callback, _PTR).value,
                     q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())
        phases = self.phase_seconds
        if phases is not None:
            assert phases.dtype == np.float64 and phases.shape == (len(self.PHASES),)
        status = self._lib.decode_layers(ctypes.addressof(self._layers), self.num_layers,
                                         ctypes.addressof(shape), ctypes.addressof(step),
                                         x.data_ptr(),
                                         None if phases is None else phases.ctypes.data)
        if errors:
            raise errors[0]
        if status:
            raise IndexError(f"{status} KV slots outside the pool's "
                             f"{pool.shape[2] * pool.shape[3]}")

    def _chunk_attention(self, chunks, q, k, v, o, pool, errors: list):
        """The per-layer callback: every chunk's rows of o, as the numba backend computes them
        (a failure is kept in ``errors`` and stops the step)."""

        def attend(layer: int) -> int:
            try:
                k_cache, v_cache = pool[layer, 0], pool[layer, 1]
                for c in chunks:
                    o[c.start : c.end] = torch_backend.chunk_attention(
                        q, k, v, k_cache, v_cache, c, self._scale, self.windows[layer])
                return 0
            except BaseException as exc:  # noqa: BLE001  (re-raised by __call__)
                errors.append(exc)
                return 1

        return attend

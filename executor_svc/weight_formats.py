"""The executor's weight formats (``CONTINUUM_WEIGHT_FORMAT``, executor_svc/settings.py);
measurements: docs/executor-performance.md.

* ``native``: a converted GGUF's own block tensors (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16,
  BF16), dequantized inside kernels/cpu_qgemm.cpp. Values equal ``gguf.quants.dequantize``'s,
  so greedy outputs stay token-exact; ~4.5-8.5 bits a weight streamed instead of 32.
* ``hybrid``: ``native`` plus an fp32 packed copy of each projection and the LM head for
  GEMMs over 8 tokens; the same bits as ``native`` (tests/kernels/test_qgemm.py), 4 bytes
  a weight more.
* ``bf16``: an HF directory's fp32 weights rounded (outputs close to, not equal to, fp32).
* ``fp32``: dequantized / safetensors fp32, packed for cpu_gemm.cpp.
* ``auto``: ``hybrid`` where ``native`` applies and the copy takes at most
  ``HYBRID_MEMORY_SHARE`` of memory at load, ``native`` where it does not fit, else fp32.

A converted directory keeps its GGUF's blocks in ``gguf_blocks.st`` (``save_native``).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import uuid

import numpy as np
import torch
from gguf import GGUFReader
from safetensors import safe_open
from safetensors.torch import save_file

from executor_svc.models.base import Architecture
from executor_svc.settings import WEIGHT_FORMATS  # one list of the names
from kernels import native, quant

log = logging.getLogger(__name__)

# auto picks hybrid when its fp32 copy takes at most this share of available_memory().
HYBRID_MEMORY_SHARE = 1 / 8
NATIVE_FILE = "gguf_blocks.st"  # safetensors, but not *.safetensors: the fp32 loaders glob those


def has_native(path: pathlib.Path) -> bool:
    """Whether ``path`` is a GGUF conversion with its blocks saved (``gguf_blocks.st``)."""
    return (path / NATIVE_FILE).is_file()


def resolve(requested: str, path: pathlib.Path, lib: native.NativeKernels | None,
            gemm: bool, tp: bool) -> str:
    """The format to load: ``requested`` checked against what this model and machine allow
    (ValueError saying why, for an explicit request that cannot be met)."""
    if requested not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {requested!r}: expected one of {WEIGHT_FORMATS}")
    if requested == "fp32":
        return "fp32"
    why = ("tensor parallelism reads fp32 safetensors slices" if tp else
           "the native kernels are not in use (fp32 on an AVX2 CPU, CONTINUUM_NATIVE_KERNELS "
           "and CONTINUUM_NATIVE_GEMM on)" if lib is None or not gemm else None)
    if requested == "bf16":
        if why:
            raise ValueError(f"weight format bf16 needs the native GEMM: {why}")
        return "bf16"
    if why is None and not has_native(path):
        why = f"{path} is not a GGUF conversion (no {NATIVE_FILE})"
    if why is None:
        if requested != "auto":
            return requested
        copy, free = wide_copy_bytes(path), available_memory()
        if free is not None and copy > free * HYBRID_MEMORY_SHARE:
            log.info("weight format auto -> native (the hybrid fp32 copy, %d MB, is over "
                     "%.3g of the %d MB available)", copy >> 20, HYBRID_MEMORY_SHARE, free >> 20)
            return "native"
        return "hybrid"
    if requested in ("native", "hybrid"):
        raise ValueError(f"weight format {requested} is not available: {why}")
    log.info("weight format auto -> fp32 (%s)", why)
    return "fp32"


def wide_copy_bytes(path: pathlib.Path) -> int:
    """Bytes of ``hybrid``'s fp32 copy of a conversion's blocks (from the metadata only)."""
    with safe_open(str(path / NATIVE_FILE), framework="pt") as f:
        formats = json.loads(f.metadata()["formats"])
    return sum(rows * cols * 4 for fmt, rows, cols in formats.values() if fmt != 0)


def available_memory(root: pathlib.Path = pathlib.Path("/")) -> int | None:
    """Bytes this process may still take: MemAvailable, or less where a cgroup limit
    (v2 memory.max, v1 memory.limit_in_bytes: a container's) leaves less; None where
    neither can be read."""
    found = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = root / "sys/fs/cgroup"
    for limit, used in (("memory.max", "memory.current"),
                        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            found.append(int((cgroup / limit).read_text()) - int((cgroup / used).read_text()))
            break
        except (OSError, ValueError):  # absent, or "max": no limit
            continue
    return max(0, min(found)) if found else None


def save_native(reader: GGUFReader, out_dir: pathlib.Path, arch: Architecture) -> None:
    """Writes ``gguf_blocks.st`` in ``out_dir``: every GGUF tensor under its HF name as
    stored (uint8 rows of blocks; 1-D ones and formats cpu_qgemm.cpp cannot read as fp32),
    Q/K rows in HF's order (where ``arch`` says llama.cpp permuted them for its rope, undone:
    a row permutation, exact), each tensor's format and shape in the metadata. Once per
    conversion (executor_svc/model_files.py): GGUFReader parses the ~50k-entry vocabulary in
    Python (seconds), a safetensors file then loads in milliseconds."""
    from executor_svc.gguf_convert import _dequantize, hf_name, hf_values

    def field(name: str, default=None):
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    prefix = field("general.architecture")
    heads = field(f"{prefix}.attention.head_count")
    kv_heads = field(f"{prefix}.attention.head_count_kv", heads)
    tensors, formats = {}, {}
    for t in reader.tensors:
        name = hf_name(arch, t.name)
        if len(t.shape) == 1:
            tensors[name] = torch.from_numpy(hf_values(arch, name, np.array(t.data,
                                                                           dtype=np.float32)))
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])
        raw = quant.RawTensor(int(t.tensor_type), (rows, cols),
                              np.asarray(t.data).reshape(rows, -1).view(np.uint8))
        if raw.format == 0 or not quant.readable(raw):
            raw = quant.RawTensor(0, (rows, cols), _dequantize(t).reshape(rows, cols))
        n = heads if name.endswith("q_proj.weight") else kv_heads
        if arch.gguf_rope_permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            order = np.arange(rows).reshape(n, rows // n // 2, 2).swapaxes(1, 2).reshape(-1)
            raw = raw.take_rows(order)
        tensors[name] = torch.from_numpy(np.array(raw.data))  # a copy: the memmap is read-only
        formats[name] = [raw.format, rows, cols]
    tmp = out_dir / f".{NATIVE_FILE}.{uuid.uuid4().hex[:8]}"  # concurrent writers: own files
    save_file(tensors, str(tmp), metadata={"formats": json.dumps(formats)})
    tmp.chmod(0o644)
    os.replace(tmp, out_dir / NATIVE_FILE)


def read_native(path: pathlib.Path) -> dict[str, torch.Tensor | quant.RawTensor]:
    """``save_native``'s tensors: 1-D ones as float32 tensors, 2-D ones as RawTensors."""
    with safe_open(str(path / NATIVE_FILE), framework="pt") as f:
        formats = json.loads(f.metadata()["formats"])
        out: dict[str, torch.Tensor | quant.RawTensor] = {}
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_tensor(name)
            if name not in formats:
                out[name] = t
                continue
            fmt, rows, cols = formats[name]
            out[name] = quant.RawTensor(fmt, (rows, cols), t.numpy())
    return out


def fuse(parts: list) -> torch.Tensor | list:
    """q/k/v or gate/up stacked by rows: one tensor, or (native) the list of RawTensors."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0)
    return list(parts)


def prepare(lib: native.NativeKernels, w, fmt: str):
    """A projection (tensor, RawTensor or list of them) in the GEMM's form for ``fmt``:
    native.PackedWeight (fp32) or quant.QuantWeight (blocks, bf16; hybrid: blocks with
    their fp32 copy)."""
    parts = w if isinstance(w, list) else [w]
    if all(isinstance(p, torch.Tensor) for p in parts):
        dense = torch.cat(parts) if len(parts) > 1 else parts[0]
        if fmt == "bf16" and dense.shape[1] % 32 == 0:
            return quant.QuantWeight(lib, [quant.RawTensor.bf16(dense)])
        return lib.pack_weight(dense)
    raws = [p if isinstance(p, quant.RawTensor) else
            quant.RawTensor(0, tuple(p.shape), p.float().numpy()) for p in parts]
    weight = quant.QuantWeight(lib, raws)
    if fmt == "hybrid":
        weight.add_wide_copy()
    return weight


def embedding(lib: native.NativeKernels, w, fmt: str):
    """The token embedding for the lookup (and a tied LM head): blocks stay blocks (Q8_0 is
    a quarter of fp32's bytes), bf16 is rounded; an fp32 tensor stays a tensor."""
    if isinstance(w, quant.RawTensor) and w.format != 0:
        return quant.QuantWeight(lib, [w])
    dense = w if isinstance(w, torch.Tensor) else torch.from_numpy(np.array(w.data))
    if fmt == "bf16" and dense.shape[1] % 32 == 0:
        return quant.QuantWeight(lib, [quant.RawTensor.bf16(dense)])
    return dense.float()


def streamed_bytes(w, tokens: int = 1) -> int:
    """Bytes a step of ``tokens`` columns reads for weight ``w`` (bench_executor.py's
    roofline): hybrid's fp32 copy past the narrow kernel's 8 columns, else as stored."""
    if isinstance(w, quant.QuantWeight):
        wide = tokens > quant.NARROW_MAX_COLUMNS and w.wide_nbytes
        return w.wide_nbytes if wide else w.nbytes
    return w.numel() * (w.element_size() if isinstance(w, torch.Tensor) else 4)

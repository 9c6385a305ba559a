"""The executor's device and KV-pool flags, which ``continuum serve`` takes too and passes
on: defined once, and importable without torch (the CLI parses them before anything
loads)."""

from __future__ import annotations

import argparse
import re

DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"
WEIGHT_FORMATS = ("auto", "native", "hybrid", "fp32", "bf16")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512M', '64k' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1GiB, 512MiB)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N; "
                        "tensor-parallel rank r uses the r-th GPU from the one named")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=None,
                   help="device KV pool per rank, e.g. 4GiB (default: 1GiB on the CPU; on a "
                        "GPU what --gpu-memory-utilization leaves)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default=None,
                   help="how the layers' weights are held: native (a GGUF's own quantized "
                        "blocks, dequantized inside the GEMM), hybrid (the blocks for "
                        "batches of <= 8 tokens, an fp32 copy for larger ones: same "
                        "outputs), fp32, bf16 (HF directories); default auto: hybrid for a "
                        "GGUF where the native GEMM runs and the copy takes <= 1/8 of free "
                        "memory, else native, else fp32 (overrides CONTINUUM_WEIGHT_FORMAT)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of each GPU the executor may use: weights, one step of "
                        "--max-num-batched-tokens, and the KV cache in what is left")


def check_device_arguments(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``p.error`` (exit 2, usage and one line) for a value no device could take."""
    if not 0 < a.gpu_memory_utilization <= 1:  # also refuses NaN
        p.error(f"--gpu-memory-utilization must be a fraction of the GPU's memory in (0, 1], "
                f"e.g. 0.9; got {a.gpu_memory_utilization}")
    if not re.fullmatch(DEVICE_PATTERN, a.device):
        p.error(f"--device must be auto, cpu, cuda or cuda:N (e.g. cuda:1), not {a.device!r}")

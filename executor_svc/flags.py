"""The executor's flags, defined once and importable without torch (the CLI parses them
before anything loads): the device and KV-pool ones, which ``continuum serve`` takes too
and passes on, and the rest of ``python -m executor_svc``'s."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from runtime import cpu_priority

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


def add_executor_arguments(p: argparse.ArgumentParser, backends: Sequence[str],
                           dtypes: Sequence[str]) -> None:
    """Every flag of ``python -m executor_svc`` (``backends``: the attention kernels'
    names; ``dtypes``: the element types, "auto" first), the internal ones rank 0 sets on
    its workers' command lines hidden."""
    p.add_argument("--model", default="", help="GGUF file or HF dir; empty: bundled SmolLM2")
    p.add_argument("--ipc", required=True, help="scheduler address, e.g. ipc:///tmp/c.sock")
    add_device_arguments(p)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens in one step (the scheduler's limit); a GPU runs one such "
                        "step at start to reserve its activation memory")
    p.add_argument("--host-kv-cache-bytes", type=parse_bytes, default=0,
                   help="host (swap) pool; 0 disables swapping")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=dtypes, default="auto",
                   help="weights' element type (auto: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run decode steps op by op instead of replaying CUDA graphs")
    p.add_argument("--kv-cache-dtype", choices=dtypes, default="auto",
                   help="KV cache element type (auto: --dtype). float16 or bfloat16 with a "
                        "float32 model halves the KV bytes per token: twice the blocks for "
                        "the same --kv-cache-bytes and half attention's reads; logits move "
                        "slightly (greedy outputs may differ from a float32 cache)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cpu-nice", type=int, default=0,
                   help="lower this process's CPU share to this nice value (0-19; its "
                        "session's autogroup too: runtime/cpu_priority.py), so that on a "
                        "shared host the gateway and scheduler keep the CPU they need to "
                        "answer at once; 0 (default): unchanged")
    p.add_argument("--model-id", default=None,
                   help="served name (default: the model directory's name, as the gateway's)")
    p.add_argument("--warmup-tokens", type=int, default=128,
                   help="prefill length timed at start for the cost model")
    p.add_argument("--attention-backend", choices=backends, default=None,
                   help="paged attention kernel (default: numba on the CPU, in place, compiled "
                        "once and cached; torch on a GPU)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks (processes); KV and thread flags are per rank")
    p.add_argument("--tp-timeout-s", type=float, default=60.0,
                   help="how long a rank waits in a collective before giving the group up")
    p.add_argument("--standby", action="store_true",
                   help="register as a warm standby: loaded and idle until the scheduler's "
                        "executor dies or hangs, then it takes over on the next step (an "
                        "executor with no peer in service is taken at once)")
    p.add_argument("--incarnation-file", default=None,
                   help="write the incarnation of each Hello to this file (removed at exit), "
                        "so a probe can ask the scheduler whether it holds this executor in "
                        "service or as its standby (deploy/probe.py executor "
                        "--incarnation-file)")
    for internal in ("--tp-rank", "--tp-init-method", "--incarnation"):  # rank 0 -> workers
        p.add_argument(internal, type=int if internal == "--tp-rank" else str,
                       default=0 if internal == "--tp-rank" else None, help=argparse.SUPPRESS)


def check_executor_arguments(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``p.error`` (exit 2, usage and one line) for any flag value no executor could take."""
    if a.block_size < 1 or (a.threads is not None and a.threads < 1) or a.warmup_tokens < 1:
        p.error("--block-size, --threads and --warmup-tokens must be positive")
    if a.max_num_batched_tokens < 1:
        p.error("--max-num-batched-tokens must be positive")
    if not 0 <= a.cpu_nice <= cpu_priority.LOWEST:
        p.error(f"--cpu-nice must be 0..{cpu_priority.LOWEST}, got {a.cpu_nice}")
    check_device_arguments(p, a)
    if a.tp_size < 1 or a.tp_timeout_s <= 0:
        p.error("--tp-size and --tp-timeout-s must be positive")
    if not 0 <= a.tp_rank < a.tp_size or (a.tp_rank and not (a.tp_init_method and a.incarnation)):
        p.error("--tp-rank is set by rank 0 for its workers only")
    if not a.ipc.startswith(("ipc://", "tcp://", "inproc://")):
        p.error(f"--ipc must be a zmq address such as ipc:///tmp/continuum.sock, got {a.ipc!r}")

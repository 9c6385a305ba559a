"""The executor's one frozen config: its flags (``ExecutorConfig``; runtime/config_flags.py)
and its environment switches (``Switches``), read here, once, and nowhere else.

Entry points read the switches with ``Switches.from_env``; components get values as
keyword arguments whose defaults mean "nothing set", so tests need no environment.
Imports neither torch nor the kernels (``continuum serve`` reads ``cache_dir`` here).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from executor_svc.faults import ENV_FAULT_INJECT, FaultInjector
from runtime import cpu_priority
from runtime.config_flags import check_bounds, knob

DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"
WEIGHT_FORMATS = ("auto", "native", "hybrid", "fp32", "bf16")
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
# kernels/__init__.py's BACKEND_NAMES (tests/executor/test_settings.py holds them equal):
# named here so the CLI offers them without loading torch.
ATTENTION_BACKENDS = ("numba", "torch", "triton", "flash-attn", "reference")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512M', '64k' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1GiB, 512MiB)")
    return int(match.group(1)) * _UNITS[match.group(2)]


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


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """The executor's flags, validated once, and the environment's ``switches``; components
    get the fields they need. Byte sizes, threads and the KV pool are per rank."""

    model: str | None = knob(None, "GGUF file or Hugging Face model directory (Llama, Qwen2, "
                                   "Qwen3, Mistral, Gemma 3) (default: the bundled "
                                   "SmolLM2-135M-Instruct)")
    ipc: str = knob(help="the executor channel, e.g. ipc:///run/continuum/replica.sock (a "
                        "ZeroMQ address; serve: a private temp ipc:// path)")
    device: str = knob("auto", "auto (cuda when torch sees a GPU, else cpu), cpu, cuda or "
                               "cuda:N; tensor-parallel rank r uses the r-th GPU from the one "
                               "named")
    kv_cache_bytes: int | None = knob(None, "device KV pool per rank, e.g. 4GiB (default: "
                                            "1GiB on the CPU; on a GPU what "
                                            "--gpu-memory-utilization leaves)",
                                      parse=parse_bytes, lo=1)
    weight_format: str | None = knob(
        None, "how the layers' weights are held: native (a GGUF's own quantized blocks, "
              "dequantized inside the GEMM), hybrid (the blocks for batches of <= 8 tokens, an "
              "fp32 copy for larger ones: same outputs), fp32, bf16 (HF directories); default "
              "auto: hybrid for a GGUF where the native GEMM runs and the copy takes <= 1/8 of "
              "free memory, else native, else fp32 (overrides CONTINUUM_WEIGHT_FORMAT)",
        choices=WEIGHT_FORMATS)
    gpu_memory_utilization: float = knob(0.9, "fraction of each GPU the executor may use: "
                                              "weights, one step of --max-num-batched-"
                                              "tokens, and the KV cache in what is left",
                                         above=0, hi=1)
    max_num_batched_tokens: int = knob(2048, "tokens computed per step across all sequences",
                                       lo=1)
    swap_space_bytes: int = knob(0, "host (CPU) memory per rank for swapped-out KV, e.g. "
                                    "4GiB (vLLM's --swap-space is GiB); 0: preempted "
                                    "sequences are always recomputed", parse=parse_bytes, lo=0)
    block_size: int = knob(16, "tokens per KV block", lo=1)
    dtype: str = knob("auto", "weights' element type (auto: bfloat16 on a GPU, float32 on the "
                              "CPU)", choices=DTYPE_NAMES)
    kv_cache_dtype: str = knob("auto", "KV element type (auto: --dtype); float16 or bfloat16 "
                                       "with a float32 model halves the bytes per token: twice "
                                       "the sequences in the same pool and half attention's "
                                       "reads, but logits move slightly, so outputs are not "
                                       "token-exact against a float32 cache",
                               choices=DTYPE_NAMES)
    enforce_eager: bool = knob(False, "on a GPU, run decode steps op by op instead of "
                                      "replaying CUDA graphs")
    threads: int | None = knob(None, "torch threads per rank (default: all the process may "
                                     "use, split between ranks)", lo=1)
    executor_nice: int = knob(0, "the executor's lowered CPU share (nice 0-19, its session's "
                                 "autogroup too: runtime/cpu_priority.py), so the gateway and "
                                 "scheduler answer at once on a host the executor saturates "
                                 "(0: unchanged; measured in docs/reliability.md, row burst)",
                              lo=0, hi=cpu_priority.LOWEST)
    warmup_tokens: int = knob(128, "prefill length timed at start for the cost model", lo=1)
    attention_backend: str | None = knob(None, "paged attention kernel (default: numba on the "
                                               "CPU, torch on a GPU)",
                                         choices=ATTENTION_BACKENDS)
    tp_size: int = knob(1, "tensor-parallel ranks (processes)", lo=1)
    tp_timeout_s: float = knob(60.0, "how long a rank waits in a collective before giving "
                                     "the group up", above=0)
    model_id: str | None = knob(None, "served name (default: the model directory's name, as "
                                      "the gateway's)", serve=False)
    standby: bool = knob(False, "register as a warm standby: loaded and idle until the "
                                "scheduler's executor dies or hangs, then it takes over on the "
                                "next step", serve=False)
    incarnation_file: str | None = knob(None, "write the incarnation of each Hello to this "
                                              "file (removed at exit), for a probe asking "
                                              "the scheduler whether it holds this executor "
                                              "(deploy/probe.py)", serve=False)
    # Set by rank 0 for ranks 1..N-1 (executor_svc/tp_ranks.py).
    tp_rank: int = knob(0, serve=False, hidden=True)
    tp_init_method: str | None = knob(None, serve=False, hidden=True)
    incarnation: str | None = knob(None, serve=False, hidden=True)
    switches: Switches = field(default_factory=Switches)

    def __post_init__(self) -> None:
        check_bounds(self, ValueError)
        if not re.fullmatch(DEVICE_PATTERN, self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N (e.g. cuda:1), not "
                             f"{self.device!r}")
        if not self.ipc.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"--ipc must be a zmq address such as "
                             f"ipc:///tmp/continuum.sock, got {self.ipc!r}")
        if not self.tp_rank < self.tp_size or (
                self.tp_rank and not (self.tp_init_method and self.incarnation)):
            raise ValueError("--tp-rank is set by rank 0 for its workers only")

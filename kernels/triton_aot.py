"""Compiles the Triton kernels for a CUDA target on a machine without a GPU.

    python -m kernels.triton_aot               # sm_90 (H100/H200), bf16 at the 8B shape
    python -m kernels.triton_aot --dtype fp16 --dtype fp32 --arch 80

The interpreter (TRITON_INTERPRET, what the suite runs) accepts code the compiler refuses;
this goes through the real pipeline (Triton IR -> PTX -> ptxas, all inside the triton
wheel) and prints each kernel's registers, spills and shared memory from the cubin
(the wheel's cuobjdump). No driver needed. A minute or two per dtype on a busy CPU.
Not part of the suite: run it after editing
kernels/triton_kernels.py, where no GPU is lent.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import triton_kernels as K
from kernels.triton_attention import (
    DECODE_BLOCK_N,
    LAUNCH,
    PREFILL_BLOCK_M,
    PREFILL_BLOCK_N,
)

LABELLED = ("NUM_SPLITS", "DOT_F32", "SLIDING")  # the constexprs a report line names
INDEX = {"TABLES": "*i64", "CTX": "*i64", "QSTART": "*i64", "SEQS": "*i64", "SLOTS": "*i64",
         "PART_O": "*fp32", "PART_LSE": "*fp32", "qk_scale": "fp32"}


def variants(dtype: str, group: int, head_dim: int, kv_heads: int):
    """(kernel, pointer types, constexprs): what a step at this shape launches."""
    t = f"*{dtype}"
    f32 = dtype == "fp32"
    data = {"Q": t, "K": t, "V": t, "OUT": t, "K_CACHE": t, "V_CACHE": t}
    block_h = max(16, 1 << (group - 1).bit_length())
    for sliding in (False, True):  # full attention, and a sliding window's variants
        for splits in (1, 4):
            yield K.decode_split_kernel, data, dict(
                GROUP=group, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_N=DECODE_BLOCK_N,
                BLOCK_D=head_dim, NUM_SPLITS=splits, DOT_F32=f32, SLIDING=sliding)
        yield K.prefill_kernel, data, dict(
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N,
            BLOCK_D=head_dim, DOT_F32=f32, SLIDING=sliding)
    yield K.decode_reduce_kernel, data, dict(HEAD_DIM=head_dim, BLOCK_D=head_dim,
                                             NUM_SPLITS=4, BLOCK_S=4)
    yield K.kv_write_kernel, data, dict(NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                                        BLOCK=kv_heads * head_dim)


def compile_one(fn, types: dict, constexprs: dict, target: GPUTarget):
    signature = {n: "constexpr" if n in constexprs else types.get(n) or INDEX.get(n, "i32")
                 for n in fn.arg_names}
    options = LAUNCH if fn in (K.decode_split_kernel, K.prefill_kernel) else None
    return triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)


def resource_usage(cubin: bytes) -> str:
    """cuobjdump's REG / STACK / SHARED line for the kernel, or why there is none."""
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                              capture_output=True, text=True)
    found = re.search(r"REG:\d+.*", done.stdout)
    return found.group(0).strip() if found else f"(cuobjdump: {done.stderr.strip()[:80]})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.triton_aot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100)")
    p.add_argument("--dtype", action="append", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--group", type=int, default=4, help="query heads per KV head (8B: 4)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kv-heads", type=int, default=8)
    a = p.parse_args(argv)
    target = GPUTarget("cuda", a.arch, 32)
    failed = 0
    for dtype in a.dtype or ["bf16"]:
        for fn, types, constexprs in variants(dtype, a.group, a.head_dim, a.kv_heads):
            start = time.perf_counter()
            label = f"{dtype} {fn.__name__} " + " ".join(
                f"{k}={v}" for k, v in constexprs.items() if k in LABELLED)
            try:
                kernel = compile_one(fn, types, constexprs, target)
            except Exception as exc:  # a compile error is the finding: report them all
                failed += 1
                print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            print(f"ok   {label:<52} {time.perf_counter() - start:5.1f} s  "
                  f"{resource_usage(kernel.asm['cubin'])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The Triton kernels compiled for the GPU equal the reference there (scripts/gpu_check.sh).

Skipped without CUDA (every CPU run of the suite); the CPU runs them through the interpreter
in test_triton_attention.py. About 16 kernel builds (seconds each, the first time): the
cases are those of ``python -m kernels.triton_check``, cut to what fits gpu_check's limit.
"""

from __future__ import annotations

import sys

import pytest
import torch

from kernels.triton_attention import TritonAttentionBackend, available


def _interpreted() -> bool:
    """Whether this process already decorated the kernels for the interpreter (another test
    module ran first): they would then run on the CPU, proving nothing about the GPU."""
    kernels = sys.modules.get("kernels.triton_kernels")
    return kernels is not None and "Interpreted" in type(kernels.prefill_kernel).__name__


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and available("cuda")),
                       reason="needs a CUDA device and triton"),
]


@pytest.fixture(autouse=True)
def _compiled_kernels():
    if _interpreted():  # decided at the first launch, after collection: checked per test
        pytest.skip("the kernels were built for the interpreter in this process: run this "
                    "file on its own (scripts/gpu_check.sh does)")


def _check(case_name: str, dtype: torch.dtype, backend: TritonAttentionBackend) -> None:
    from kernels import triton_check as tc

    case = next(c for c in tc.cases(quick=False) if c.name == case_name)
    step = tc.paged_step(case, dtype, "cuda", seed=1)
    scale = case.dim ** -0.5
    got = tc._run(backend, step, scale).float()
    want = tc._want(case, step, scale)
    assert not got.isnan().any(), "a NaN slot no sequence owns was read"
    err = (got - want).abs().max().item()
    assert err <= tc.TOLERANCE[dtype], f"{case_name} {dtype}: max error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mixed_step_matches_reference_on_cuda(dtype):
    _check("mixed GQA 3", dtype, TritonAttentionBackend())


def test_split_k_decode_matches_reference_on_cuda():
    _check("decode long", torch.bfloat16, TritonAttentionBackend(num_splits=4))


@pytest.mark.parametrize("case", ["8B decode b32 4k", "8B prefill 2x512+pfx"])
def test_8b_shaped_steps_match_the_torch_backend_on_cuda(case):
    _check(case, torch.bfloat16, TritonAttentionBackend())


def test_kv_write_matches_index_copy_on_cuda():
    from kernels.triton_check import check_kv_write

    assert check_kv_write("cuda", quick=False) == []


def test_the_gpu_default_is_an_in_place_kernel():
    from kernels import backend_for, make_backend

    assert backend_for(None, "cuda") in ("flash-attn", "triton")
    assert make_backend(None, "cuda").forward is not None

"""GPU correctness check of the Triton (and flash-attn) attention against the reference.

    python -m kernels.triton_check    # on CUDA: one table; rc 0 ok, 1 a miss, 2 cannot run
    TRITON_INTERPRET=1 python -m kernels.triton_check --device cpu --quick   # the CI smoke run

Small steps are checked against kernels/reference.py (float64); 8B-shaped steps (bf16,
fp16) against the torch backend on the device, which the suite checks against the
reference. Every step has tables with holes and blocks out of order, partial last blocks,
NaN in every unowned slot (and before every window). On CUDA each row also times one
layer's attention call. Its first run compiles some 40 kernel variants.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend, AttentionMetadata, window_start
from kernels.reference import ReferenceAttentionBackend
from kernels.torch_backend import TorchAttentionBackend
from kernels.triton_attention import TritonAttentionBackend, available, kv_write

# Max abs error allowed against a float32-or-better answer, by pool dtype.
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    name: str
    specs: tuple[tuple[int, int], ...]  # (query_len, context_len) per sequence
    block_size: int
    hq: int
    hkv: int
    dim: int
    against: str  # "reference" or "torch"
    window: int = 0  # a sliding window; 0: full attention


def cases(quick: bool) -> list[Case]:
    small = [
        Case("mixed GQA 3", ((1, 37), (9, 40), (1, 5), (20, 20)), 16, 9, 3, 64, "reference"),
        Case("decode long", ((1, 700), (1, 3), (1, 260)), 16, 8, 2, 32, "reference"),
        Case("odd block 5", ((1, 19), (7, 31)), 5, 4, 1, 80, "reference"),
        Case("window 37 mixed", ((1, 300), (40, 200), (1, 20), (60, 60)), 16, 8, 2, 32,
             "reference", window=37),
    ]
    if quick:
        return [Case("mixed", ((1, 21), (6, 30), (5, 5)), 8, 4, 2, 16, "torch")]
    big = [
        Case("8B decode b32 4k", tuple((1, 4096 - 61 * i) for i in range(32)), 16, 32, 8, 128,
             "torch"),
        Case("8B decode b2 8k", ((1, 8192), (1, 5000)), 16, 32, 8, 128, "torch"),
        Case("8B prefill 2x512+pfx", ((512, 1536), (512, 512), (1, 900)), 16, 32, 8, 128,
             "torch"),
        Case("8B decode b16 4k w512", tuple((1, 4096) for _ in range(16)), 16, 32, 8, 128,
             "torch", window=512),
        Case("8B prefill w512 pfx", ((512, 2048), (1, 3000)), 16, 32, 8, 128, "torch",
             window=512),
    ]
    return small + big


def paged_step(case: Case, dtype: torch.dtype, device, seed: int = 0):
    """q, k/v caches and metadata for ``case``: tables drawn from a shuffled pool with
    spare blocks, NaN in every slot no sequence owns."""
    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    counts = [-(-ctx // bs) for _, ctx in case.specs]
    num_blocks = sum(counts) + 7
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for c in counts:
        tables.append(order[at : at + c])
        at += c
    owned = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for (n, ctx), table in zip(case.specs, tables, strict=True):
        pos = torch.arange(window_start(ctx - n, case.window), ctx)  # before it: never read
        owned[torch.tensor(table)[pos // bs], pos % bs] = True
    shape = (num_blocks, bs, case.hkv, case.dim)
    caches = []
    for _ in range(2):
        c = torch.randn(shape, generator=gen)
        c[~owned] = float("nan")
        caches.append(c.to(dtype).to(device))
    meta = AttentionMetadata.build([n for n, _ in case.specs], [c for _, c in case.specs],
                                   tables, bs, device)
    tokens = sum(n for n, _ in case.specs)
    q = torch.randn(tokens, case.hq, case.dim, generator=gen).to(dtype).to(device)
    return q, caches[0], caches[1], meta


def _run(backend: AttentionBackend, step, scale: float, window: int = 0) -> torch.Tensor:
    q, k_cache, v_cache, meta = step
    return backend.forward(q, None, None, k_cache, v_cache, backend.prepare(meta), scale,
                           window=window)


def _time_ms(backend: AttentionBackend, step, scale: float, device,
             window: int = 0) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    q, k_cache, v_cache, meta = step
    plan = backend.prepare(meta)
    for _ in range(3):
        backend.forward(q, None, None, k_cache, v_cache, plan, scale, window=window)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        backend.forward(q, None, None, k_cache, v_cache, plan, scale, window=window)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def _zero_nan(step):
    q, k_cache, v_cache, meta = step
    return q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), meta


def _want(case: Case, step, scale: float) -> torch.Tensor:
    q, k_cache, v_cache, meta = step
    if case.against == "torch":
        clean = _zero_nan((q.float(), k_cache.float(), v_cache.float(), meta))
        return _run(TorchAttentionBackend(), clean, scale, case.window).float()
    cpu = AttentionMetadata.build(list(meta.query_lens), list(meta.context_lens),
                                  meta.block_tables.cpu().tolist(), meta.block_size)
    return ReferenceAttentionBackend().forward(
        q.cpu(), None, None, k_cache.cpu(), v_cache.cpu(), cpu, scale,
        window=case.window).float().to(q.device)


def candidates(device) -> list[tuple[str, AttentionBackend]]:
    found = [("triton", TritonAttentionBackend()),
             ("triton split4", TritonAttentionBackend(num_splits=4))]
    if torch.device(device).type == "cuda":
        from kernels.flash_attn_backend import FlashAttnBackend, importable

        if importable():  # block size 16 goes to the fallback: this row checks the hand-off
            found.append(("flash-attn", FlashAttnBackend(fallback=TritonAttentionBackend())))
        found.append(("torch", TorchAttentionBackend()))
    return found


def check_kv_write(device, quick: bool) -> list[str]:
    """One launch vs index_copy_, every pool dtype; returns the failures."""
    bad = []
    blocks, tokens, hkv, dim = (4, 12, 2, 16) if quick else (40, 300, 8, 128)
    for label, dtype in DTYPES.items():
        pool = torch.zeros(2, blocks, 16, hkv, dim, dtype=dtype, device=device)
        want = pool.clone()
        slots = torch.randperm(blocks * 16, device=device)[:tokens]
        k = torch.randn(tokens, hkv, dim, device=device)
        v = torch.randn(tokens, hkv, dim, device=device)
        kv_write(k, v, pool[0], pool[1], slots)
        want[0].view(-1, hkv, dim).index_copy_(0, slots, k.to(dtype))
        want[1].view(-1, hkv, dim).index_copy_(0, slots, v.to(dtype))
        ulp = 0.0 if torch.device(device).type == "cuda" else 1e-2  # interpreter truncates
        if not torch.allclose(pool.float(), want.float(), atol=ulp, rtol=ulp):
            bad.append(f"kv_write {label}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.triton_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="one tiny case per dtype (CI smoke)")
    a = p.parse_args(argv)
    if not available(a.device):
        print(f"triton kernels cannot run on {a.device} here (CUDA, or TRITON_INTERPRET=1 on "
              "the CPU, and the triton package)", file=sys.stderr)
        return 2
    failures = check_kv_write(a.device, a.quick)
    print(f"{'case':<22} {'dtype':<5} {'backend':<14} {'max err':>9} {'tol':>7} "
          f"{'ms/call':>8}  ok")
    for case in cases(a.quick):
        for label, dtype in DTYPES.items():
            if dtype == torch.float32 and case.against == "torch":
                continue  # the small cases cover float32 pools; these shapes are bf16/fp16
            step = paged_step(case, dtype, a.device)
            scale = case.dim ** -0.5
            want = _want(case, step, scale)
            for name, backend in candidates(a.device):
                # The torch backend gathers whole blocks: NaN in a masked slot would reach
                # its P @ V (0 * NaN); real pools start zeroed (executor_svc/kv_cache.py).
                step_for = _zero_nan(step) if name == "torch" else step
                got = _run(backend, step_for, scale, case.window).float()
                err = (got - want).abs().max().item()
                ok = err <= TOLERANCE[dtype] and not got.isnan().any().item()
                ms = _time_ms(backend, step_for, scale, a.device, case.window)
                print(f"{case.name:<22} {label:<5} {name:<14} {err:>9.2e} "
                      f"{TOLERANCE[dtype]:>7.0e} {'' if ms is None else f'{ms:8.3f}':>8}  "
                      f"{'ok' if ok else 'MISS'}")
                if not ok:
                    failures.append(f"{case.name} {label} {name}")
    print("kv_write: " + ("ok" if not any(f.startswith("kv_write") for f in failures) else
                          "MISS"))
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    print("all triton attention checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

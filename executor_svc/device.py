"""Where the executor runs (``--device``) and how much of a GPU its KV cache may take.

On the CPU the KV pool is a fixed byte budget (``--kv-cache-bytes``). On a GPU the pool is
what is left of ``--gpu-memory-utilization`` of the device once the model is loaded and a
forward of ``--max-num-batched-tokens`` tokens has run, as production servers size it: a
fixed budget would either waste most of a large GPU or not fit a small one.
"""

from __future__ import annotations

import logging
import re

import torch

from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.models.decoder import DecoderModel
from executor_svc.runner import profile_activation_bytes
from executor_svc.settings import DEVICE_PATTERN

log = logging.getLogger("executor")
_GIB = 1 << 30


def resolve_device(spec: str, tp_rank: int = 0, tp_size: int = 1) -> torch.device:
    """``--device`` (auto, cpu, cuda, cuda:N) -> this rank's device; raises ValueError when
    this machine lacks a device the group needs.

    Tensor-parallel rank r takes the r-th GPU from the one named (``cuda``: cuda:r), so the
    ranks of one executor never share a device.
    """
    if not re.fullmatch(DEVICE_PATTERN, spec):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, not {spec!r}")
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: this torch build has no CUDA device available "
                         "(torch.cuda.is_available() is False); use --device cpu")
    first = int(spec.split(":")[1]) if ":" in spec else 0
    count = torch.cuda.device_count()
    if first + tp_size > count:
        needs = f"cuda:{first}" if tp_size == 1 else f"cuda:{first}..cuda:{first + tp_size - 1}"
        raise ValueError(f"--device {spec} --tp-size {tp_size} needs {needs}, but {count} CUDA "
                         "device(s) are visible; lower --tp-size or pick another --device")
    return torch.device("cuda", first + tp_rank)


def gpu_kv_blocks(
    total_bytes: int,  # the device's memory
    used_bytes: int,  # in use once the model is loaded: weights, CUDA context, other processes
    activation_bytes: int,  # a --max-num-batched-tokens step's peak, beyond its starting point
    utilization: float,  # --gpu-memory-utilization, 0 < u <= 1
    block_bytes: int,  # one KV block, every layer
    min_blocks: int = 1,  # what one max-length sequence needs
) -> int:
    """KV blocks that fit in ``utilization`` of the device besides what the model and a
    full step need; raises ValueError saying what to change when that is under
    ``min_blocks`` (a pool that cannot hold one whole sequence cannot serve it)."""
    budget = int(total_bytes * utilization) - used_bytes - activation_bytes
    blocks = max(0, budget) // block_bytes
    needed = max(1, min_blocks)
    if blocks < needed:
        raise ValueError(
            f"no room for the KV cache: {utilization:g} x {total_bytes / _GIB:.2f} GiB of GPU "
            f"memory leaves {blocks} KV blocks of {block_bytes / (1 << 20):.2f} MiB, but one "
            f"max-length sequence needs {needed}; the weights, CUDA context and other "
            f"processes use {used_bytes / _GIB:.2f} GiB and a step's activations "
            f"{activation_bytes / _GIB:.2f} GiB. Lower --max-num-batched-tokens, raise "
            "--gpu-memory-utilization, use a smaller model (or a narrower --dtype / "
            "--kv-cache-dtype), or split it over more GPUs with --tp-size"
        )
    return blocks


def fit_gpu_kv_cache(model: DecoderModel, spec: KVCacheSpec, backend, tokens: int,
                     utilization: float) -> int:
    """KV blocks for this rank's GPU (``gpu_kv_blocks`` after a profiled step of ``tokens``,
    --max-num-batched-tokens), the smallest count of any rank under tp so that a block id
    means the same on every rank.

    The profiling step writes its K/V into a scratch pool of its own size. What stays in
    use is read from the driver only after that pool and the step's memory are handed back:
    it then counts weights, the CUDA context, NCCL's and cuBLAS's buffers and other
    processes, and nothing twice.
    """
    device = model.embed.device
    weights = torch.cuda.memory_allocated(device)
    scratch = KVCache(spec, -(-tokens // spec.block_size), device=device)
    activations = profile_activation_bytes(model, scratch, backend, tokens)
    del scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    one_sequence = -(-model.config.max_position_embeddings // spec.block_size)
    error, blocks = None, 0
    try:
        blocks = gpu_kv_blocks(total, total - free, activations, utilization, spec.block_bytes,
                               one_sequence)
    except ValueError as exc:  # raised after the collective, which every rank must join
        error = exc
    if model.tp is not None:
        blocks = model.tp.min_over_ranks(blocks)
    if error is not None:
        raise error
    if blocks == 0:
        raise ValueError("another tensor-parallel rank has no room for the KV cache "
                         "(see its error)")
    log.info("%s: %.2f GiB, %.2f in use after loading (weights %.2f); a %d-token step's "
             "activations %.2f GiB; KV cache %d blocks = %.2f GiB (--gpu-memory-utilization "
             "%g)", device, total / 2**30, (total - free) / 2**30, weights / 2**30, tokens,
             activations / 2**30, blocks, blocks * spec.block_bytes / 2**30, utilization)
    return blocks


def resolve_dtype(name: str, device: torch.device) -> str:
    """``--dtype`` -> the weights' (and, with ``--kv-cache-dtype auto``, the KV cache's)
    element type: ``auto`` is bfloat16 on a GPU (half the bytes every decode step reads,
    tensor cores' type) and float32 on the CPU (the native kernels' type)."""
    if name != "auto":
        return name
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def decode_graphs(model: DecoderModel, kv: KVCache, enforce_eager: bool):
    """Captured decode-step CUDA graphs (executor_svc/cuda_graphs.py) for this model and
    pool, or None, logged, where they cannot run: not on CUDA, ``--enforce-eager``, tensor
    parallelism, or no Triton. Call before any sequence exists (capture writes the pool)."""
    device = model.embed.device
    why = ("not on CUDA" if device.type != "cuda" else "--enforce-eager" if enforce_eager
           else "--tp-size > 1" if model.tp is not None else None)
    if why is None:
        from kernels import triton_attention

        if not triton_attention.available(device):
            why = "triton is not installed"
    if why is not None:
        if device.type == "cuda":
            log.info("decode steps run eagerly, no CUDA graphs: %s", why)
        return None
    from executor_svc.cuda_graphs import BUCKETS, DecodeGraphs

    graphs = DecodeGraphs(model, kv, max_batch=max(BUCKETS))
    graphs.capture()
    return graphs

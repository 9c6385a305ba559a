"""Step time of Llama-3-70B BF16 on 4×A100-80GB (SXM, NVSwitch), tensor parallel 4.

One formula for every step, whatever mixes of prefill chunks and decodes it holds
(docs/design.md §2: a sequence computes ``q`` new tokens over ``c`` cached ones):

    step = emb(T) + L·[linear(T) + 2·all_reduce(T·hidden·2 B) + attention(seqs)]
           + lm_head(sampled) + cpu_overhead,        T = tokens in the step
    step ≥ (weights read once + every KV byte read) ÷ HBM bandwidth   (physical floor)

* ``linear(T)``: the measured per-layer time of every non-attention operator
  (norms, QKV/O projections, rope, gated MLP, adds) at tp 4 from Vidur's A100
  profile, median of repeats, made monotone in T (isotonic fit: the small-T
  points are noisy) and interpolated linearly between measured token counts;
  beyond the largest (32,768) it grows linearly.
* ``all_reduce``: measured NCCL all-reduce on 4 GPUs of a DGX A100 (NVSwitch),
  isotonic, interpolated by message size; two per layer (after attention, after MLP).
* ``attention``: not in the profile, so a roofline per kernel and per layer:
  decodes (q = 1) read their KV at ``decode_attn_bw_efficiency`` × 2.04 TB/s;
  prefill chunks run max(FLOPs ÷ (312 TFLOPS × ``prefill_attn_flops_efficiency``),
  KV bytes ÷ bandwidth); each kernel also costs ``attn_launch_s``.
* ``lm_head``: the vocabulary projection for sampled sequences only (roofline).
* ``cpu_overhead``: per-step host time (scheduling, input preparation, sampling)
  that a GPU does not hide. 3 ms, from vLLM 0.6.6's own numbers: multi-step
  scheduling, which amortises exactly this, raised offline throughput 714 → 756
  tokens/s (≈ 5.5 % of a ≈ 55–65 ms step).

All times here are seconds.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

from sim.data import data_dir

GIB = 1 << 30
_NON_ATTENTION_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
                      "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj",
                      "add")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Llama-3-70B (and 3.3-70B: same shapes)."""

    num_layers: int = 80
    hidden: int = 8192
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 28672
    vocab: int = 128256
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 × 80 × 8 × 128 × 2 B = 320 KiB."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def layer_params(self) -> int:
        kv = self.num_kv_heads * self.head_dim
        attn = self.hidden * (2 * self.hidden + 2 * kv)  # q, o, k, v
        return attn + 3 * self.hidden * self.intermediate  # gate, up, down

    @property
    def weight_bytes(self) -> int:
        """All weights: layers, input embedding and LM head (untied): ≈ 141 GB."""
        return self.dtype_bytes * (self.num_layers * self.layer_params
                                   + 2 * self.vocab * self.hidden)

    @property
    def streamed_weight_bytes(self) -> int:
        """Weights every decode step reads in full: all but the embedding table,
        of which a step reads only its tokens' rows: ≈ 139 GB (docs/design.md §7)."""
        return self.weight_bytes - self.dtype_bytes * self.vocab * self.hidden


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """4×A100-80GB SXM; the efficiencies are stated assumptions, not measurements."""

    tp: int = 4
    hbm_bytes_per_s: float = 2.04e12
    peak_flops: float = 312e12  # dense BF16
    device_memory_bytes: int = 80 * GIB
    gpu_memory_utilization: float = 0.90  # vLLM's default share of the device
    activation_headroom_bytes: int = 4 * GIB  # activations, CUDA graphs, NCCL buffers
    decode_attn_bw_efficiency: float = 0.6
    prefill_attn_flops_efficiency: float = 0.5
    attn_launch_s: float = 10e-6
    cpu_overhead_s: float = 3e-3
    # Swap: each GPU copies its share of a block over its own PCIe 4.0 x16 link (32 GB/s
    # raw; ~20 GB/s is what pinned cudaMemcpy reaches), into vLLM's default 4 GiB host pool.
    pcie_bytes_per_s: float = 20e9
    host_swap_bytes_per_gpu: int = 4 * GIB


class Curve:
    """A measured y(x): isotonic (non-decreasing) fit, linear in between, linear beyond."""

    def __init__(self, points: Iterable[tuple[float, float]]) -> None:
        merged: dict[float, list[float]] = {}
        for x, y in points:
            merged.setdefault(float(x), []).append(float(y))
        xs = sorted(merged)
        if not xs:
            raise ValueError("a curve needs at least one point")
        ys = _isotonic([sorted(merged[x])[len(merged[x]) // 2] for x in xs])
        self.xs, self.ys = xs, ys
        # Beyond the last point: the slope over its upper half (GEMMs are linear in T there).
        k = bisect.bisect_left(xs, xs[-1] / 2)
        dx = xs[-1] - xs[k]
        self.tail_slope = (ys[-1] - ys[k]) / dx if dx > 0 else 0.0

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1] + (x - xs[-1]) * self.tail_slope
        i = bisect.bisect_right(xs, x)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _isotonic(ys: Sequence[float]) -> list[float]:
    """Pool-adjacent-violators: the closest non-decreasing sequence (least squares)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2 = blocks.pop()
            m1, w1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    out: list[float] = []
    for mean, weight in blocks:
        out.extend([mean] * int(weight))
    return out


def load_linear_profile(path: Path, tp: int) -> tuple[Curve, Curve]:
    """(per-layer non-attention seconds, embedding seconds) by tokens in the batch."""
    layer, emb = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if int(row["num_tensor_parallel_workers"]) != tp:
                continue
            n = int(row["num_tokens"])
            ms = sum(float(row[f"time_stats.{op}.median"]) for op in _NON_ATTENTION_OPS)
            layer.append((n, ms * 1e-3))
            emb.append((n, float(row["time_stats.emb.median"]) * 1e-3))
    if not layer:
        raise ValueError(f"{path}: no rows for {tp} tensor-parallel workers")
    return Curve(layer), Curve(emb)


def load_all_reduce(path: Path, num_workers: int) -> Curve:
    """All-reduce seconds by message bytes, all ``num_workers`` GPUs on one node."""
    points = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if int(row["num_workers"]) == num_workers and \
                    int(row["devices_per_node"]) == num_workers:
                points.append((int(row["size"]), float(row["time_stats.all_reduce.median"])
                               * 1e-3))
    if not points:
        raise ValueError(f"{path}: no rows for {num_workers} workers on one node")
    return Curve(points)


class StepCostModel:
    """Seconds for one step of the batch plan; see the module docstring."""

    def __init__(self, model: ModelSpec = ModelSpec(), hw: HardwareSpec = HardwareSpec(),
                 profiles: Path | None = None) -> None:
        profiles = profiles or data_dir() / "profiles" / "a100"
        self.model, self.hw = model, hw
        self.linear, self.emb = load_linear_profile(profiles / "llama3_70b_mlp.csv", hw.tp)
        self.all_reduce = load_all_reduce(profiles / "all_reduce_dgx.csv", hw.tp)
        m = model
        heads = m.num_heads // hw.tp
        # Per layer and GPU: attention FLOPs per (query, key) pair, KV bytes per token.
        self._flops_per_pair = 4 * heads * m.head_dim  # QKᵀ and PV, 2 FLOPs a MAC
        self._kv_layer_bytes = m.kv_bytes_per_token // (m.num_layers * hw.tp)
        self._lm_head_bytes = m.dtype_bytes * m.vocab * m.hidden / hw.tp
        self._weights_floor_s = m.streamed_weight_bytes / hw.tp / hw.hbm_bytes_per_s
        self._kv_gpu_bytes = m.kv_bytes_per_token / hw.tp

    # -- memory ---------------------------------------------------------------------

    @property
    def kv_pool_bytes_per_gpu(self) -> int:
        """Device × utilization − this GPU's weights − activation headroom."""
        hw = self.hw
        return int(hw.device_memory_bytes * hw.gpu_memory_utilization
                   - self.model.weight_bytes / hw.tp - hw.activation_headroom_bytes)

    def num_kv_blocks(self, block_size: int) -> int:
        per_block = block_size * self.model.kv_bytes_per_token // self.hw.tp
        return self.kv_pool_bytes_per_gpu // per_block

    def host_kv_blocks(self, block_size: int) -> int:
        """Blocks the host (swap) pool holds: the same per-GPU share of each block."""
        return self.hw.host_swap_bytes_per_gpu // (block_size * self.model.kv_bytes_per_token
                                                   // self.hw.tp)

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        """Copying ``num_blocks`` between device and host: the GPUs copy their shares in
        parallel, each over its own link."""
        per_gpu = block_size * self.model.kv_bytes_per_token / self.hw.tp
        return num_blocks * per_gpu / self.hw.pcie_bytes_per_s

    def core_cost_model(self, block_size: int):
        """The scheduler's swap-or-recompute model, as an executor's Hello would fill it."""
        from scheduler_svc.core import CostModel

        return CostModel(1024 / self.prefill_time(1024), self.hw.pcie_bytes_per_s,
                         block_size * self.model.kv_bytes_per_token // self.hw.tp)

    # -- time -----------------------------------------------------------------------

    def floor_s(self, kv_tokens_read: int) -> float:
        """Weights plus every KV byte read once at full bandwidth: no step is faster."""
        return self._weights_floor_s + kv_tokens_read * self._kv_gpu_bytes / self.hw.hbm_bytes_per_s

    def step_time(self, seqs: Iterable[tuple[int, int]], num_sampled: int | None = None) -> float:
        """``seqs``: (new tokens q, cached tokens c) per sequence in the step.
        ``num_sampled``: sequences that sample (default: all)."""
        hw = self.hw
        num_tokens = num_seqs = 0
        decode_kv = 0  # KV tokens the decode kernel reads
        prefill_flops = 0.0
        prefill_kv = 0
        num_prefills = 0
        for q, c in seqs:
            num_seqs += 1
            num_tokens += q
            if q == 1:
                decode_kv += c + 1
            else:
                num_prefills += 1
                prefill_flops += q * (c + (q + 1) / 2)
                prefill_kv += c + q
        if num_tokens == 0:
            return 0.0
        attn = 0.0
        if decode_kv:
            attn += hw.attn_launch_s + decode_kv * self._kv_layer_bytes / (
                hw.hbm_bytes_per_s * hw.decode_attn_bw_efficiency)
        if num_prefills:
            compute = prefill_flops * self._flops_per_pair / (
                hw.peak_flops * hw.prefill_attn_flops_efficiency)
            memory = prefill_kv * self._kv_layer_bytes / hw.hbm_bytes_per_s
            attn += hw.attn_launch_s + max(compute, memory)
        per_layer = (self.linear(num_tokens)
                     + 2 * self.all_reduce(num_tokens * self.model.hidden * 2) + attn)
        sampled = num_seqs if num_sampled is None else num_sampled
        lm_head = 0.0
        if sampled:
            lm_head = max(self._lm_head_bytes / hw.hbm_bytes_per_s,
                          sampled * self._lm_head_bytes / hw.peak_flops)  # 2 FLOPs/param
        t = (self.emb(num_tokens) + self.model.num_layers * per_layer + lm_head
             + hw.cpu_overhead_s)
        return max(t, self.floor_s(decode_kv + prefill_kv))

    def decode_step_time(self, batch: int, context: int) -> float:
        """A pure decode step: ``batch`` sequences, each with ``context`` cached tokens."""
        return self.step_time([(1, context)] * batch)

    def prefill_time(self, num_tokens: int) -> float:
        """One prompt of ``num_tokens`` prefilled alone in one step."""
        return self.step_time([(num_tokens, 0)])

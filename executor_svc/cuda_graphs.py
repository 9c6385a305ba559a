"""CUDA graphs for decode steps: one graph per batch-size bucket (docs/gpu.md, "Decode
CUDA graphs").

A decode step of B sequences is padded to the smallest bucket >= B (``BUCKETS``) and
replayed; anything else runs eagerly (``choose`` says why). Inputs come from static
buffers each step overwrites on the device; logits go to a static [bucket, V] buffer,
sampled on the device. Padding repeats the last real row (``pad_rows``), which writes
bit-identical K/V into that row's own slot, so the cache is as without padding. Attention
uses Triton at a fixed split count with static index buffers (``_StaticBackend``).
``replay=False`` runs the same path eagerly: how the CPU tests check it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from executor_svc.batch import StepInputs
from kernels.attention import AttentionBackend, AttentionMetadata

log = logging.getLogger("executor.graphs")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(n: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket that holds ``n`` rows; None above the largest (or for n < 1)."""
    if n < 1:
        return None
    return next((b for b in sorted(buckets) if b >= n), None)


@dataclass(frozen=True)
class GraphChoice:
    bucket: int | None  # the graph to replay; None: run eagerly
    reason: str  # why not, when bucket is None (logged once per reason)


def choose(query_lens: tuple[int, ...], num_sampling: int, table_width: int,
           captured: tuple[int, ...], max_blocks: int) -> GraphChoice:
    """Whether a step may replay a graph: decode only (every sequence one token, every
    sequence sampling), a captured bucket that holds it, and a block table no wider than
    the captured ``max_blocks``."""
    n = len(query_lens)
    if n == 0 or any(q != 1 for q in query_lens):
        return GraphChoice(None, "a prefill or chunk in the step")
    if num_sampling != n:
        return GraphChoice(None, "a row that does not sample")
    bucket = bucket_for(n, captured)
    if bucket is None:
        return GraphChoice(None, f"{n} sequences: above the largest captured bucket "
                                 f"({max(captured, default=0)})")
    if table_width > max_blocks:
        return GraphChoice(None, f"a block table of {table_width} blocks: wider than the "
                                 f"captured {max_blocks}")
    return GraphChoice(bucket, "")


def pad_rows(n: int, bucket: int, device) -> torch.Tensor:  # [bucket] int64
    """Row index per padded row: 0..n-1, then n-1 repeated (see the module docstring)."""
    return torch.arange(bucket, device=device).clamp_(max=n - 1)


class _StaticBackend(AttentionBackend):
    """The graph's attention: ``prepare`` hands back the plan built once over the static
    buffers; ``forward`` is the wrapped backend's."""

    def __init__(self, inner: AttentionBackend, plan: object) -> None:
        self.inner, self.plan = inner, plan

    def prepare(self, meta: AttentionMetadata) -> object:
        return self.plan

    def forward(self, q, k, v, k_cache, v_cache, prepared, scale, window=None):
        # A layer's window is fixed, so each layer's captured kernel keeps its own.
        return self.inner.forward(q, k, v, k_cache, v_cache, prepared, scale, window=window)


class _Bucket:
    """One bucket's static inputs, its graph (or None: eager) and its static logits."""

    def __init__(self, size: int, max_blocks: int, block_size: int, device, splits: int):
        from kernels.triton_attention import TritonAttentionBackend, TritonStepPlan

        self.size = size
        i64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(size, **i64)
        self.positions = torch.zeros(size, **i64)
        self.slot_mapping = torch.zeros(size, **i64)
        self.context_lens = torch.ones(size, **i64)
        self.rows = torch.arange(size, **i64)  # sample rows, decode rows: all of them
        meta = AttentionMetadata(
            query_lens=(1,) * size, context_lens=(1,) * size,
            query_start=torch.arange(size + 1, **i64),
            block_tables=torch.zeros(size, max_blocks, **i64), block_size=block_size)
        self.block_tables = meta.block_tables
        self.meta = meta
        plan = TritonStepPlan(meta=meta, context_lens=self.context_lens,
                              decode_seqs=self.rows, chunk_seqs=None,
                              max_decode_context=max_blocks * block_size, max_chunk_len=0)
        self.backend = _StaticBackend(TritonAttentionBackend(num_splits=splits), plan)
        self.graph = None
        self.logits: torch.Tensor | None = None

    def load(self, inputs: StepInputs) -> None:
        """Copies the step into the static buffers, padded; device ops only."""
        n, width = len(inputs.meta.query_lens), inputs.meta.block_tables.shape[1]
        rows = pad_rows(n, self.size, self.input_ids.device)
        self.input_ids.copy_(inputs.input_ids[rows])
        self.positions.copy_(inputs.positions[rows])
        self.slot_mapping.copy_(inputs.slot_mapping[rows])
        self.context_lens.copy_(self.positions + 1)  # a decode row's context ends at it
        self.block_tables[:, :width].copy_(inputs.meta.block_tables[rows])


class DecodeGraphs:
    """Decode-step graphs for one model and KV pool; ``run`` returns the logits or None
    (run eagerly). Build with ``capture`` at start, before any sequence exists."""

    def __init__(self, model, kv, max_batch: int, max_blocks: int | None = None,
                 buckets: tuple[int, ...] = BUCKETS, replay: bool = True) -> None:
        if model.tp is not None:
            raise ValueError("CUDA graphs run at --tp-size 1 only")
        self.model, self.kv, self.replay = model, kv, replay
        c = model.config
        self.max_blocks = max_blocks or -(-c.max_position_embeddings // kv.spec.block_size)
        self.buckets = tuple(b for b in sorted(buckets) if b <= max_batch) or (1,)
        self._splits = splits_for(self.max_blocks * kv.spec.block_size, model.embed.device)
        self._by_size: dict[int, _Bucket] = {}
        self._pool = None
        self._said: set[str] = set()

    def capture(self) -> None:
        """Captures every bucket, the largest first (the pool then fits the rest)."""
        device = self.model.embed.device
        if self.replay:
            self._pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.buckets, reverse=True):
            b = _Bucket(size, self.max_blocks, self.kv.spec.block_size, device, self._splits)
            if self.replay:
                self._capture(b)
            self._by_size[size] = b
        log.info("decode graphs for batch sizes %s (blocks per row <= %d, %d splits)",
                 ",".join(map(str, self.buckets)), self.max_blocks, self._splits)

    def _forward(self, b: _Bucket) -> torch.Tensor:
        return self.model.forward(b.input_ids, b.positions, b.slot_mapping, b.meta,
                                  b.backend, self.kv, b.rows)

    def _capture(self, b: _Bucket) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        b.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.graph, pool=self._pool):
            b.logits = self._forward(b)
        torch.cuda.synchronize()

    def run(self, inputs: StepInputs) -> torch.Tensor | None:  # [S, V] or None
        meta = inputs.meta
        choice = choose(meta.query_lens, len(inputs.sampling_seqs),
                        meta.block_tables.shape[1], tuple(self._by_size), self.max_blocks)
        if choice.bucket is None:
            if choice.reason not in self._said:
                self._said.add(choice.reason)
                log.info("eager step (no graph): %s", choice.reason)
            return None
        b = self._by_size[choice.bucket]
        b.load(inputs)
        if b.graph is None:
            b.logits = self._forward(b)
        else:
            b.graph.replay()
        return b.logits[: len(meta.query_lens)]


def splits_for(max_context: int, device) -> int:
    """The fixed split-K count of every graph: what the Triton backend would choose for one
    row at the longest context (short contexts leave splits empty, weighed as zero)."""
    from kernels.triton_attention import MAX_SPLITS, MIN_SPLIT_LEN

    if torch.device(device).type != "cuda":
        return min(MAX_SPLITS, 2)  # the interpreter: exercise split-K, cheaply
    return max(1, min(MAX_SPLITS, -(-max_context // MIN_SPLIT_LEN)))

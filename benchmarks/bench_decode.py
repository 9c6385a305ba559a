"""What the executor benches share: the decode run (``DecodeRun``: batch sequences at a
context, one token per step through real BatchPlans and the Runner), its one-prompt
prefill, the bytes a step streams, the read bandwidth, and their common flags."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.models.decoder import DecoderModel
from executor_svc.runner import Runner
from executor_svc.weight_formats import streamed_bytes
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2

INCARNATION = "bench"


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def add_point_args(p: argparse.ArgumentParser, batches: list[int], steps: int) -> None:
    """The flags of a decode point: batches, context, warm-up and timed steps, threads and
    the clock (``clock_of``)."""
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=batches)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps, help="timed decode steps per point")
    p.add_argument("--threads", type=int, default=None,
                   help="torch (and numba) threads; default torch's (one per core)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this process's CPU time, not wall time: robust on a busy "
                        "shared machine with --threads 1 (with more threads it counts spinning)")


def clock_of(args: argparse.Namespace):
    """Sets ``--threads``; the clock ``--cpu-time`` asks for."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return time.process_time if args.cpu_time else time.perf_counter


def best_seconds(fn, clock, repeats: int) -> float:
    """The fastest of ``repeats`` calls after one warm-up call, by ``clock``."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def read_gbs(clock, repeats: int = 10) -> float:
    """Streaming read bandwidth: the best sum over 256 MiB (more than any cache)."""
    big = torch.ones(64 << 20)
    return big.numel() * 4 / best_seconds(big.sum, clock, repeats) / 1e9


def weight_bytes(model: DecoderModel, batch: int = 1) -> int:
    """What one step of ``batch`` tokens reads of the weights: every projection and the LM
    head as stored (a tied embedding once: the lookup reads only the step's rows; hybrid's
    fp32 copy past 8 tokens), plus the norms."""
    total = sum(streamed_bytes(w, batch) for layer in model.layers
                for w in (layer.wqkv, layer.wo, layer.w13, layer.w2))
    total += sum(layer.attn_norm.numel() + layer.ffn_norm.numel() for layer in model.layers) * 4
    return total + streamed_bytes(model.lm_head, batch) + model.norm.numel() * 4


class DecodeRun:
    """``batch`` sequences at ``context`` tokens, decoding one token per step via plans."""

    def __init__(self, model: DecoderModel, backend, batch: int, context: int, steps: int,
                 clock=time.perf_counter, kv_dtype: torch.dtype = torch.float32,
                 native_options=None):
        c, bs = model.config, 16
        self.clock = clock
        self.blocks_per_seq = -(-(context + steps + 1) // bs)
        spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype, bs)
        kv = KVCache(spec, batch * self.blocks_per_seq, native_options=native_options)
        self.runner = Runner(model, kv, backend, INCARNATION)
        self.batch, self.context, self.step_id = batch, context, 0
        self.vocab = c.vocab_size

    def plan(self) -> pb.BatchPlan:
        self.step_id += 1
        plan = pb.BatchPlan(incarnation=INCARNATION, step_id=self.step_id)
        if self.step_id > 1:  # decode deltas; every block was handed out up front
            plan.cached_seq_ids.extend(range(self.batch))
            plan.cached_num_scheduled_tokens.extend([1] * self.batch)
            plan.cached_num_new_blocks.extend([0] * self.batch)
            return plan
        gen = torch.Generator().manual_seed(0)
        greedy = sampling_pb2.SamplingParams(temperature=0.0)
        for i in range(self.batch):  # arrives with context - 1 tokens cached, decodes the last
            tokens = torch.randint(3, self.vocab, (self.context,), generator=gen).tolist()
            blocks = range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq)
            plan.new_seqs.add(seq_id=i, token_ids=tokens, num_computed_tokens=self.context - 1,
                              num_scheduled_tokens=1, block_ids=blocks, sampling=greedy,
                              num_prompt_tokens=self.context)
        return plan

    def step(self) -> float:
        plan = self.plan()
        start = self.clock()
        result = self.runner.execute(plan)
        elapsed = self.clock() - start
        assert result.error_code == 0 and len(result.token_ids) == self.batch, result
        return elapsed

    def timed(self, warmup: int, steps: int) -> float:
        """Median seconds per step after ``warmup`` steps."""
        for _ in range(warmup):
            self.step()
        return statistics.median(self.step() for _ in range(steps))


def ours_prefill_tokens_per_s(model, backend, num_tokens: int, clock,
                              native_options=None) -> float:
    """One ``num_tokens`` prompt in one plan (chunk = whole prompt), best of two."""
    def once():
        run = DecodeRun(model, backend, 1, num_tokens, 0, native_options=native_options)
        plan = pb.BatchPlan(incarnation=INCARNATION, step_id=1)
        plan.new_seqs.add(seq_id=0, token_ids=[5] * num_tokens, num_scheduled_tokens=num_tokens,
                          block_ids=range(run.blocks_per_seq), num_prompt_tokens=num_tokens,
                          sampling=sampling_pb2.SamplingParams(temperature=0.0))
        start = clock()
        run.runner.execute(plan)
        return clock() - start

    return num_tokens / min(once() for _ in range(3))

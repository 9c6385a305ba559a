"""The bench's decode run (``DecodeRun``: batch sequences at a context, one token per step
through real BatchPlans and the Runner) and its one-prompt prefill, shared by
benchmarks/bench_executor.py and benchmarks/bench_formats.py."""

from __future__ import annotations

import statistics
import time

import torch

from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.models.decoder import DecoderModel
from executor_svc.runner import Runner
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2

INCARNATION = "bench"


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

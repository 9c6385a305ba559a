"""Just enough of a scheduler to drive a Runner with real BatchPlans.

Bump-allocates blocks, gives every unfinished sequence min(remaining, chunk_size) tokens per
step (so prompt chunks and decodes share steps), sends a sequence in full the first time and
as deltas afterwards, and drops it once it has ``max_new_tokens`` outputs. No EOS handling:
tests compare exact token streams.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

import torch

from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.models.decoder import DecoderModel
from executor_svc.runner import Runner
from kernels import make_backend
from kernels.attention import AttentionBackend
from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2

INCARNATION = "test-incarnation"


def make_runner(
    model: DecoderModel, num_blocks: int = 64, block_size: int = 16,
    backend: AttentionBackend | None = None, num_host_blocks: int = 0,
    kv_dtype: torch.dtype | None = None,  # --kv-cache-dtype; None: the model's
) -> Runner:
    c = model.config
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype or model.dtype,
                       block_size)
    device = model.embed.device  # the pool and the default backend follow the model
    kv = KVCache(spec, num_blocks, num_host_blocks, device)
    # None: the serving default for the device.
    return Runner(model, kv, backend or make_backend(None, device), INCARNATION)


def load_model(model_dir: pathlib.Path) -> DecoderModel:
    torch.set_num_threads(2)
    return DecoderModel.load(model_dir)


@dataclass
class _Seq:
    seq_id: int
    tokens: list[int]
    num_prompt: int
    max_new: int
    sampling: sampling_pb2.SamplingParams
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    num_shared: int = 0  # leading blocks borrowed from another sequence (prefix cache)
    host_blocks: list[int] = field(default_factory=list)  # non-empty while swapped out
    sent: bool = False

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.num_prompt >= self.max_new


class MiniScheduler:
    def __init__(self, runner: Runner, chunk_size: int = 8) -> None:
        self.runner = runner
        self.chunk_size = chunk_size
        self.block_size = runner.kv.spec.block_size
        self.seqs: dict[int, _Seq] = {}
        self.free_blocks = list(range(runner.kv.num_blocks))[::-1]
        self.to_drop: list[int] = []
        self.swaps: dict[str, list[int]] = {}  # swap_out_src, ... for the next plan
        self.step_id = 0

    def add(self, seq_id: int, prompt: list[int], max_new: int,
            sampling: sampling_pb2.SamplingParams | None = None,
            prefix_of: int | None = None, num_prefix_blocks: int = 0) -> None:
        """``prefix_of``: reuse that sequence's first blocks as cached (they must hold the
        same tokens), so this one starts with num_computed_tokens > 0."""
        greedy = sampling_pb2.SamplingParams(temperature=0.0)
        seq = _Seq(seq_id, list(prompt), len(prompt), max_new, sampling or greedy)
        if prefix_of is not None:
            seq.blocks = self.seqs[prefix_of].blocks[:num_prefix_blocks]
            seq.num_shared = num_prefix_blocks
            seq.computed = num_prefix_blocks * self.block_size
        self.seqs[seq_id] = seq

    def preempt(self, seq_id: int) -> None:
        """Recompute preemption: the executor drops the sequence; it comes back in full."""
        seq = self.seqs[seq_id]
        self.to_drop.append(seq_id)
        # Its blocks are not freed: another sequence may borrow them (no ref counts here).
        seq.blocks, seq.num_shared, seq.computed, seq.sent = [], 0, 0, False

    def swap_out(self, seq_id: int) -> None:
        """Swap preemption: blocks go to host blocks 0.., the executor drops the sequence."""
        seq = self.seqs[seq_id]
        seq.host_blocks = list(range(len(seq.blocks)))
        self.swaps.update(swap_out_src=seq.blocks, swap_out_dst=seq.host_blocks)
        self.to_drop.append(seq_id)
        self.free_blocks.extend(seq.blocks)  # reusable in the very next plan
        seq.blocks, seq.sent = [], False

    def swap_in(self, seq_id: int) -> None:
        """Back to fresh device blocks; sent in full with its computed tokens kept."""
        seq = self.seqs[seq_id]
        seq.blocks = [self.free_blocks.pop(0) for _ in seq.host_blocks]
        self.swaps.update(swap_in_src=seq.host_blocks, swap_in_dst=seq.blocks)
        seq.host_blocks = []

    def outputs(self, seq_id: int) -> list[int]:
        seq = self.seqs[seq_id]
        return seq.tokens[seq.num_prompt :]

    def build_plan(self) -> pb.BatchPlan:
        self.step_id += 1
        plan = pb.BatchPlan(incarnation=INCARNATION, step_id=self.step_id)
        plan.finished_seq_ids.extend(self.to_drop)
        for name, blocks in self.swaps.items():
            getattr(plan, name).extend(blocks)
        self.to_drop, self.swaps = [], {}
        for seq in self.seqs.values():
            if seq.done or seq.host_blocks:
                continue
            n = min(len(seq.tokens) - seq.computed, self.chunk_size)
            new_blocks = self._grow(seq, seq.computed + n)
            if not seq.sent:
                plan.new_seqs.add(
                    seq_id=seq.seq_id, token_ids=seq.tokens, num_computed_tokens=seq.computed,
                    num_scheduled_tokens=n, block_ids=seq.blocks, sampling=seq.sampling,
                    num_prompt_tokens=seq.num_prompt,
                )
                seq.sent = True
            else:
                plan.cached_seq_ids.append(seq.seq_id)
                plan.cached_num_scheduled_tokens.append(n)
                plan.cached_num_new_blocks.append(len(new_blocks))
                plan.cached_new_block_ids.extend(new_blocks)
            seq.computed += n
        return plan

    def _grow(self, seq: _Seq, num_tokens: int) -> list[int]:
        new = []
        while (len(seq.blocks) + len(new)) * self.block_size < num_tokens:
            new.append(self.free_blocks.pop())
        seq.blocks.extend(new)
        return new

    def step(self) -> pb.StepResult:
        result = self.runner.execute(self.build_plan())
        assert result.error_code == 0, result.error_message
        for seq_id, token in zip(wire.result_seq_ids(result), result.token_ids, strict=True):
            seq = self.seqs[seq_id]
            assert seq.computed == len(seq.tokens), "sampled before its tokens were computed"
            seq.tokens.append(token)
            if seq.done:
                self.to_drop.append(seq_id)
                if not any(other.num_shared for other in self.seqs.values()):
                    self.free_blocks.extend(seq.blocks)
        return result

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if all(seq.done for seq in self.seqs.values()):
                return
            self.step()
        raise AssertionError("sequences did not finish")


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (it may stop early at EOS)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
        )
    return out[0, len(prompt) :].tolist()

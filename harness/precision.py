"""How far a lower-precision model is from the fp32 one: both read the same token
sequences in one prefill each (teacher forcing: the fp32 model's greedy continuations, so
an early difference does not compound), and at every continuation position we compare the
next-token distributions. Used by the bf16 tolerance tests (tests/executor/test_precision.py
on the CPU, tests/executor/test_cuda.py on a GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.models.decoder import DecoderModel
from harness.mini_scheduler import MiniScheduler, make_runner
from kernels import make_backend
from kernels.attention import AttentionMetadata

BLOCK_SIZE = 16
# The tolerance stated for bf16 weights and activations against fp32 (docs/gpu.md), over
# the continuations of harness/prompts.py's prompts: the greedy choice agrees
# at nearly every position, and where it does not the two were near ties.
MIN_TOP1_AGREEMENT = 0.95
MAX_MEAN_KL = 0.01  # nats, mean over positions of KL(fp32 || low precision)
MAX_TIE_MARGIN = 1.0  # where the picks differ, fp32's top two are within this (logits)


@dataclass
class Comparison:
    positions: int
    top1_agreement: float  # fraction of positions where both pick the same next token
    mean_kl: float  # nats
    max_kl: float
    max_fp32_margin_where_they_differ: float  # the fp32 logit gap top-1 vs the other's pick

    def within_tolerance(self) -> bool:
        return (self.top1_agreement >= MIN_TOP1_AGREEMENT and self.mean_kl <= MAX_MEAN_KL
                and self.max_fp32_margin_where_they_differ <= MAX_TIE_MARGIN)

    def row(self) -> str:
        return (f"{self.positions} positions: top-1 agreement {self.top1_agreement:.1%}, "
                f"KL mean {self.mean_kl:.4f} max {self.max_kl:.3f} nats, widest fp32 margin "
                f"where they differ {self.max_fp32_margin_where_they_differ:.3f}")


def greedy_sequences(model: DecoderModel, prompts: list[list[int]], max_new: int
                     ) -> list[tuple[list[int], int]]:
    """(prompt + ``model``'s greedy continuation, the prompt's length) for each prompt."""
    sched = MiniScheduler(make_runner(model, num_blocks=16 * len(prompts), block_size=16),
                          chunk_size=64)
    for i, prompt in enumerate(prompts):
        sched.add(i, prompt, max_new=max_new)
    sched.run()
    return [(p + sched.outputs(i), len(p)) for i, p in enumerate(prompts)]


def all_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 next-token logits of one prefill of ``ids``."""
    c = model.config
    device = model.embed.device
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype,
                             BLOCK_SIZE), num_blocks, 0, device)
    n = len(ids)
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], BLOCK_SIZE, device)
    positions = torch.arange(n, device=device)
    return model.forward(torch.tensor(ids, device=device), positions, positions, meta,
                         make_backend("torch", device), kv, positions).float()


def compare(reference: DecoderModel, other: DecoderModel, sequences: list[tuple[list[int], int]]
            ) -> Comparison:
    """``sequences``: (token ids, the prompt's length); positions from the prompt's last
    token on are compared (the distributions that chose the continuation)."""
    agree = total = 0
    kls: list[torch.Tensor] = []
    margin = 0.0
    for ids, num_prompt in sequences:
        want = all_logits(reference, ids)[num_prompt - 1:-1]
        got = all_logits(other, ids)[num_prompt - 1:-1].to(want.device)
        p, q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
        kls.append((p.exp() * (p - q)).sum(-1))
        a, b = want.argmax(-1), got.argmax(-1)
        agree += int((a == b).sum())
        total += len(a)
        differ = (a != b).nonzero().flatten()
        if len(differ):
            gaps = want[differ, a[differ]] - want[differ, b[differ]]
            margin = max(margin, float(gaps.max()))
    kl = torch.cat(kls)
    return Comparison(total, agree / total, float(kl.mean()), float(kl.max()), margin)

"""SchedulerOutput (pure Python) → BatchPlan (wire), and StepResult → tokens.

Columnar on purpose: per-sequence sub-messages cost ~10× more to encode
(FACTS.md). Only sequences the executor has never seen travel in full.
"""

from __future__ import annotations

from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import BlockManager, SchedulerOutput


def build_plan(out: SchedulerOutput, incarnation: str, bm: BlockManager) -> pb.BatchPlan:
    plan = pb.BatchPlan(incarnation=incarnation, step_id=out.step_id)
    plan.finished_seq_ids.extend(out.finished_seq_ids)
    cached_ids: list[int] = []
    cached_tokens: list[int] = []
    cached_nblocks: list[int] = []
    cached_blocks: list[int] = []
    for s in out.scheduled:
        req = s.request
        if s.is_new:
            seq = plan.new_seqs.add(
                seq_id=req.seq_id,
                num_computed_tokens=req.num_computed_tokens - s.num_tokens,
                num_scheduled_tokens=s.num_tokens,
                num_prompt_tokens=req.num_prompt_tokens - req.num_resumed_output_tokens,
            )
            seq.token_ids.extend(req.token_ids)
            seq.block_ids.extend(bm.block_table(req.seq_id))
            if req.sampling is not None:
                seq.sampling.CopyFrom(req.sampling)
        else:
            cached_ids.append(req.seq_id)
            cached_tokens.append(s.num_tokens)
            cached_nblocks.append(len(s.new_block_ids))
            cached_blocks.extend(s.new_block_ids)
    plan.cached_seq_ids.extend(cached_ids)
    plan.cached_num_scheduled_tokens.extend(cached_tokens)
    plan.cached_num_new_blocks.extend(cached_nblocks)
    plan.cached_new_block_ids.extend(cached_blocks)
    return plan


def sampled_tokens(result: pb.StepResult) -> dict[int, int]:
    """seq_id → sampled token id."""
    return dict(zip(result.seq_ids, result.token_ids, strict=True))

"""SchedulerOutput (pure Python, columnar) → BatchPlan (wire).

Columnar on purpose: per-sequence sub-messages cost ~10× more to encode
(FACTS.md). Only sequences the executor has never seen travel in full.
"""

from __future__ import annotations

from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import BlockManager, SchedulerOutput


def build_plan(out: SchedulerOutput, incarnation: str, bm: BlockManager) -> pb.BatchPlan:
    plan = pb.BatchPlan(
        incarnation=incarnation,
        step_id=out.step_id,
        finished_seq_ids=out.finished_seq_ids,
        cached_seq_ids=[r.seq_id for r in out.cached],
        cached_num_scheduled_tokens=out.cached_num_tokens,
        cached_num_new_blocks=out.cached_num_new_blocks,
        cached_new_block_ids=out.cached_new_block_ids,
    )
    for req, n in out.new:
        seq = plan.new_seqs.add(
            seq_id=req.seq_id,
            num_computed_tokens=req.num_computed_tokens - n,
            num_scheduled_tokens=n,
            num_prompt_tokens=req.num_prompt_tokens - req.num_resumed_output_tokens,
            token_ids=req.token_ids,
            block_ids=bm.block_table(req.seq_id),
        )
        if req.sampling is not None:
            seq.sampling.CopyFrom(req.sampling)
    if out.swap_out:
        plan.swap_out_src[:], plan.swap_out_dst[:] = zip(*out.swap_out, strict=True)
    if out.swap_in:
        plan.swap_in_src[:], plan.swap_in_dst[:] = zip(*out.swap_in, strict=True)
    return plan

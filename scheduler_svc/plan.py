"""SchedulerOutput (pure Python, columnar) → BatchPlan (wire).

Columnar on purpose: per-sequence sub-messages cost ~10× more to encode
(FACTS.md). Only sequences the executor has never seen travel in full.
The plan is built in place inside its SchedulerMessage envelope, so sending
it is one ``SerializeToString`` (no copy of the plan into the envelope).
"""

from __future__ import annotations

from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import BlockManager, SchedulerOutput


def build_plan_message(out: SchedulerOutput, incarnation: str,
                       bm: BlockManager) -> pb.SchedulerMessage:
    """The frame to send for ``out``: a SchedulerMessage whose ``plan`` is set."""
    env = pb.SchedulerMessage(schema_version=wire.SCHEMA_VERSION)
    plan = env.plan
    plan.incarnation = incarnation
    plan.step_id = out.step_id
    if out.finished_seq_ids:
        plan.finished_seq_ids.extend(out.finished_seq_ids)
    plan.cached_seq_ids.extend(out.cached_seq_ids)
    plan.cached_num_scheduled_tokens.extend(out.cached_num_tokens)
    plan.cached_num_new_blocks.extend(out.cached_num_new_blocks)
    if out.cached_new_block_ids:
        plan.cached_new_block_ids.extend(out.cached_new_block_ids)
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
    return env


def build_plan(out: SchedulerOutput, incarnation: str, bm: BlockManager) -> pb.BatchPlan:
    return build_plan_message(out, incarnation, bm).plan

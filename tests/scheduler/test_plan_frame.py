"""PlanBuilder.frame writes a plan's bytes itself (prepared prompts, small-count columns
and the envelope joined as bytes): what the executor parses from them must be, field for
field, the plan built the plain protobuf way, whatever the step holds."""

from __future__ import annotations

import random

import pytest

from protos import seq_columns, wire
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2
from scheduler_svc.core import BlockManager, CostModel, Request, SchedulerOutput
from scheduler_svc.plan import PlanBuilder, _small_column, _varint
from tests.scheduler.factories import fake_execute, make_scheduler


def _reference(out: SchedulerOutput, incarnation: str, bm: BlockManager) -> pb.SchedulerMessage:
    """The plan as plain protobuf builds it, from the request as it is now."""
    env = pb.SchedulerMessage(schema_version=wire.SCHEMA_VERSION)
    plan = env.plan
    plan.incarnation = incarnation
    plan.packed_cached_seq_ids = seq_columns.pack(out.cached_seq_ids)
    plan.cached_num_scheduled_tokens.extend(out.cached_num_tokens)
    fields = pb.BatchPlan.DESCRIPTOR.fields_by_name
    for name in out._fields:  # a field of the plan's name travels as it is
        if name not in fields or name in ("cached_seq_ids", "packed_cached_seq_ids"):
            continue
        value = getattr(out, name)
        if fields[name].is_repeated:
            getattr(plan, name).extend(value)
        elif value:
            setattr(plan, name, value)
    for req, n in out.new:
        seq = plan.new_seqs.add(
            seq_id=req.seq_id, token_ids=req.token_ids,
            num_computed_tokens=req.num_computed_tokens - n, num_scheduled_tokens=n,
            block_ids=bm.block_table(req.seq_id),
            num_prompt_tokens=req.num_prompt_tokens - req.num_resumed_output_tokens)
        if req.sampling is not None:
            seq.sampling.CopyFrom(req.sampling)
    for src, dst in out.swap_out:
        plan.swap_out_src.append(src)
        plan.swap_out_dst.append(dst)
    for src, dst in out.swap_in:
        plan.swap_in_src.append(src)
        plan.swap_in_dst.append(dst)
    return env


def _request(rng: random.Random, seq_id: int) -> Request:
    prompt = [rng.randrange(3, 50_000) for _ in range(rng.randint(1, 300))]
    sampling = None
    if rng.random() < 0.5:
        sampling = sampling_pb2.SamplingParams(temperature=rng.random(), top_k=rng.randint(0, 50))
    return Request(seq_id=seq_id, token_ids=prompt, num_prompt_tokens=len(prompt),
                   max_tokens=rng.randint(1, 80), request_id=f"r{seq_id}", sampling=sampling)


@pytest.mark.parametrize("seed", range(4))
def test_the_frame_parses_to_the_plain_protobuf_plan(seed):
    rng = random.Random(seed)
    swap = CostModel(prefill_tokens_per_s=10.0, swap_bytes_per_s=1e9, block_bytes=1000)
    # A pool that cannot hold the running set (preemptions, swaps, resumes with output
    # already generated) and chunks above 127 tokens (counts that are not one byte).
    sched = make_scheduler(num_blocks=96, block_size=4, num_host_blocks=32 if seed % 2 else 0,
                           cost=swap, max_num_seqs=12, max_num_batched_tokens=600,
                           chunk_size=rng.choice((130, 160)))
    plans = PlanBuilder(sweep_every=8)
    base = 1 << rng.choice((0, 20, 40, 62))  # seq ids of 1 to 9 varint bytes
    kinds = set()
    for i in range(60):
        req = _request(rng, base + i)
        sched.add_request(req)
        if rng.random() < 0.7:
            plans.prepare(req)  # else the step that sends it prepares it
    for _ in range(2000):
        out = sched.schedule()
        if out.is_empty:
            break
        sent = pb.SchedulerMessage.FromString(plans.frame(out, "inc", sched.block_manager))
        assert sent == _reference(out, "inc", sched.block_manager)
        kinds.update(k for k, v in (("big", any(n > 127 for n in out.cached_num_tokens)),
                                    ("resume", any(len(r.token_ids) > r.num_prompt_tokens
                                                   for r, _ in out.new)),
                                    ("swap", out.swap_out or out.swap_in)) if v)
        sched.update(out, *fake_execute(out))
    assert {"big", "resume"} <= kinds and (seed % 2 == 0 or "swap" in kinds)


@pytest.mark.parametrize("values", [[1] * 5, [0, 1, 127], [128], [1, 255, 3], [256, 1],
                                    [2**32 - 1, 0], [300] * 3])
def test_a_small_count_column_is_protobufs_own_encoding(values):
    plan = pb.BatchPlan(cached_num_new_blocks=values)
    assert pb.BatchPlan.FromString(_small_column("cached_num_new_blocks", values)) == plan
    assert _small_column("cached_num_new_blocks", []) == b""


@pytest.mark.parametrize("value", [1, 127, 128, 300, 16383, 16384, 2**21, 2**32 + 5, 2**63])
def test_a_varint_is_protobufs_own_encoding(value):
    """One byte, two (the looked-up and the computed forms) and the general loop."""
    encoded = pb.BatchPlan(step_id=value).SerializeToString()  # the field's key, the varint
    assert _varint(value) == encoded[1:]
    assert _varint(0) == b"\x00"

"""The plan, the step record and the events (core/plan.py): the plan that is sent is
never changed after ``schedule()`` returns it, events have one shape, the block manager
answers with typed results, and the prompt's wire form lives with the plan builder."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from protos.continuum.v1 import executor_pb2, sampling_pb2
from scheduler_svc.core import NEEDS_GROW, BlockManager, Event, FinishReason, Request
from scheduler_svc.logprobs import with_logprobs
from scheduler_svc.plan import PlanBuilder
from tests.scheduler.factories import EOS, fake_execute, make_request, make_scheduler, step


def _snapshot(out) -> dict:
    return {name: copy.copy(getattr(out, name)) for name in out._fields}


def test_the_plan_is_immutable_and_update_leaves_it_as_sent():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4,
                           max_num_batched_tokens=32, chunk_size=8)
    for i in range(4):
        sched.add_request(make_request(prompt_len=6 + i, max_tokens=12))
    for _ in range(6):
        step(sched)
    out = sched.schedule()  # decode mode and block starts in it
    assert out.num_bulk > 0
    with pytest.raises(AttributeError):
        out.num_bulk = 0
    sent = _snapshot(out)
    seq_ids, tokens = fake_execute(out)
    tokens[0] = EOS  # a stop in the bulk: a sequence leaves while the plan is answered
    sched.update(out, seq_ids, tokens)
    sched.assert_invariants()
    assert _snapshot(out) == sent
    nxt = sched.schedule()
    assert nxt.finished_seq_ids == [seq_ids[0]] and _snapshot(out) == sent


def test_events_have_four_fields_and_logprobs_fill_the_fourth():
    sched = make_scheduler(num_blocks=64, block_size=4)
    req = make_request(prompt_len=5, max_tokens=2)
    sched.add_request(req)
    out = sched.schedule()
    events = sched.update(out, *fake_execute(out))
    assert [len(ev) for ev in events] == [4]
    got, token, reason, logprob = events[0]
    assert got is req and token is not None and reason is None and logprob is None
    assert events[0] == Event(req, token, None)  # a plain 4-tuple equals its Event
    result = executor_pb2.StepResult(seq_ids=[req.seq_id], token_ids=[token],
                                     logprobs=[-0.5], top_n=[1], top_token_ids=[token],
                                     top_logprobs=[-0.5])
    (ev,) = with_logprobs(events, result)
    assert isinstance(ev, Event) and ev[:3] == events[0][:3]
    assert ev.logprob == sampling_pb2.TokenLogprob(token_id=token, logprob=-0.5,
                                                   top_token_ids=[token], top_logprobs=[-0.5])
    assert sched.abort(req.request_id) == Event(req, None, FinishReason.ABORT, None)


def test_try_append_block_answers_a_block_none_or_needs_grow():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.grow(1, 4)
    assert bm.try_append_block(1, 4) is None  # position 4 fits in its block
    block = bm.try_append_block(1, 5)
    assert isinstance(block, int) and bm.block_table(1)[-1] == block
    bm.grow(2, 1)  # the pool is empty now
    assert bm.try_append_block(1, 9) is NEEDS_GROW
    assert bm.try_append_block(2, 12) is NEEDS_GROW  # more than one block
    bm.assert_invariants()


def test_the_prompts_wire_form_lives_with_the_plan_builder():
    assert "wire" not in {f.name for f in dataclasses.fields(Request)}
    sched = make_scheduler(num_blocks=64, block_size=4)
    plans = PlanBuilder(sweep_every=4)
    reqs = [make_request(prompt_len=6, max_tokens=1) for _ in range(3)]
    for req in reqs:
        sched.add_request(req)
        plans.prepare(req)
    req = reqs[0]
    req.token_ids[0] = 999  # changed after arrival: the prepared form is what is sent
    out = sched.schedule()
    sent = {s.seq_id: list(s.token_ids) for s in plans.message(out, "inc",
                                                               sched.block_manager).plan.new_seqs}
    assert sent[req.seq_id][0] != 999 and len(sent) == 3
    sched.update(out, *fake_execute(out))  # max_tokens=1: all finish
    assert all(r.is_finished for r in reqs)
    assert plans.num_prepared == 3
    plans.prepare(make_request())  # the 4th arrival sweeps: finished requests' entries go
    assert plans.num_prepared == 1

"""The plan, the step record and the events (core/plan.py): the plan that is sent is
never changed after ``schedule()`` returns it, events have one shape, the block manager
answers with typed results, and the prompt's wire form lives with the plan builder."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from protos import seq_columns
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


def _history(sched) -> dict[str, list[int]]:
    return {r.request_id: list(r.token_ids) for r in sched.running}


def test_packed_answers_apply_as_plain_ones_whatever_their_order():
    """The executor's packed ids (protos/seq_columns.py): in plan order they are checked as
    bytes and applied column-wise; in another order they are read and applied one by one.
    Either way every sequence gets its own token, as with the plain column."""
    scheds = [make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4,
                             max_num_batched_tokens=32, chunk_size=8) for _ in range(3)]
    for sched in scheds:
        for i in range(4):
            sched.add_request(make_request(request_id=f"r{i}", prompt_len=6 + i,
                                           max_tokens=20))
    for n in range(14):
        events = []
        for k, sched in enumerate(scheds):
            out = sched.schedule()
            seq_ids, tokens = fake_execute(out)
            if k == 1:  # packed, in plan order
                answer = (seq_columns.pack(seq_ids), tokens)
            elif k == 2:  # packed, reversed
                answer = (seq_columns.pack(seq_ids[::-1]), tokens[::-1])
            else:
                answer = (seq_ids, tokens)
            events.append(sorted((ev[0].request_id, ev[1]) for ev in sched.update(out, *answer)))
            sched.assert_invariants()
        assert events[0] == events[1] == events[2], n
        assert _history(scheds[0]) == _history(scheds[1]) == _history(scheds[2])
    plain, in_order, reversed_ = scheds
    assert in_order.num_update_fallbacks == plain.num_update_fallbacks == 0
    assert reversed_.num_update_fallbacks > 0  # read and applied one by one

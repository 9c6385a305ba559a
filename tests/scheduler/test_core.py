"""The scheduler core on its own: progress model, budgets, preemption, aborts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core import ConfigError, FinishReason, RequestStatus, SchedulerConfig
from tests.scheduler.factories import (
    EOS,
    fake_execute,
    make_request,
    make_scheduler,
    run_to_completion,
)


def test_core_imports_no_torch_grpc_or_zmq():
    code = (
        "import sys, scheduler_svc.core\n"
        "bad = sorted(m for m in ('torch', 'grpc', 'zmq') if m in sys.modules)\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "must be >= max_num_seqs"),
        ({"chunk_size": 4096}, "chunk_size (4096) must be <="),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"watermark_blocks": -1}, "watermark_blocks must be >= 0"),
    ],
)
def test_config_rejects_bad_values_with_a_clear_message(kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**kwargs)
    assert fragment in str(err.value)


def test_long_prompt_is_chunked_and_samples_only_on_its_last_chunk():
    sched = make_scheduler(chunk_size=16, max_num_batched_tokens=16, max_num_seqs=4)
    req = make_request(prompt_len=40, max_tokens=2)
    sched.add_request(req)
    steps = [sched.schedule() for _ in range(3)]
    assert [s.scheduled[0].num_tokens for s in steps] == [16, 16, 8]
    assert [s.scheduled[0].samples for s in steps] == [False, False, True]
    assert [s.scheduled[0].is_new for s in steps] == [True, False, False]
    assert sched.block_manager.block_table(req.seq_id) == list(range(10))


def test_decodes_come_first_and_new_requests_join_next_step():
    sched = make_scheduler(chunk_size=10, max_num_batched_tokens=10, max_num_seqs=4)
    a = make_request(prompt_len=8, max_tokens=5)
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, fake_execute(out))
    b = make_request(prompt_len=20, max_tokens=5)
    sched.add_request(b)
    out = sched.schedule()
    # a decodes (1 token), b gets what is left of the budget (9 of 10)
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(a, 1), (b, 9)]


def test_every_request_completes_and_all_blocks_return():
    sched = make_scheduler(num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    reqs = [make_request(prompt_len=3 + 5 * i, max_tokens=6) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert sched.block_manager.num_free_blocks == 64


def test_preemption_by_recompute_loses_and_duplicates_nothing():
    def outputs(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, chunk_size=8, max_num_batched_tokens=16,
                               max_num_seqs=8, watermark_blocks=0)
        reqs = [make_request(prompt_len=6, max_tokens=20, request_id=f"q{i}") for i in range(6)]
        for r in reqs:
            sched.add_request(r)
        run_to_completion(sched)
        assert sched.block_manager.num_free_blocks == num_blocks
        return [r.token_ids for r in reqs], sched.num_preemptions

    roomy, n_roomy = outputs(256)
    tight, n_tight = outputs(16)
    assert n_roomy == 0 and n_tight > 0
    assert tight == roomy


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back():
    sched = make_scheduler()
    stop = make_request(max_tokens=10, request_id="stop")
    ignore = make_request(max_tokens=10, request_id="ignore", ignore_eos=True)
    early = make_request(max_tokens=10, request_id="early", min_tokens=5)
    for r in (stop, ignore, early):
        sched.add_request(r)
    run_to_completion(sched, eos_at={"stop": 3, "ignore": 3, "early": 2})
    assert (stop.finish_reason, stop.num_output_tokens, stop.token_ids[-1]) == (
        FinishReason.STOP, 4, EOS)
    assert (ignore.finish_reason, ignore.num_output_tokens) == (FinishReason.LENGTH, 10)
    assert (early.finish_reason, early.num_output_tokens) == (FinishReason.LENGTH, 10)


def test_abort_is_idempotent_frees_blocks_and_tells_the_executor():
    sched = make_scheduler(num_blocks=32)
    req = make_request(prompt_len=10, max_tokens=50)
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, fake_execute(out))
    assert sched.block_manager.num_free_blocks < 32
    event = sched.abort(req.request_id)
    assert event.finish_reason == FinishReason.ABORT
    assert sched.abort(req.request_id) is None
    assert sched.block_manager.num_free_blocks == 32
    out = sched.schedule()
    assert out.finished_seq_ids == (req.seq_id,) and not out.scheduled
    # A result for the aborted sequence that raced the abort is ignored.
    assert sched.update(out, {req.seq_id: 123}) == []


def test_new_executor_recomputes_running_sequences_in_full():
    sched = make_scheduler(num_blocks=32)
    req = make_request(prompt_len=10, max_tokens=50)
    sched.add_request(req)
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, fake_execute(out))
    history = list(req.token_ids)
    sched.attach_executor(sched.model)
    assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.is_new and s.num_tokens == len(history) and s.samples
    assert out.finished_seq_ids == ()  # the new executor holds nothing to drop


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), min_size=1, max_size=12),
    num_blocks=st.integers(20, 80),
    chunk=st.integers(1, 16),
    seqs=st.integers(1, 6),
)
def test_invariants_hold_for_any_workload(lens, num_blocks, chunk, seqs):
    sched = make_scheduler(num_blocks=num_blocks, chunk_size=chunk,
                           max_num_batched_tokens=max(chunk, seqs), max_num_seqs=seqs)
    reqs = [make_request(prompt_len=p, max_tokens=m) for p, m in lens if -(-p // 4) <= 16]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    assert all(r.is_finished for r in reqs)
    assert sched.block_manager.num_free_blocks == num_blocks

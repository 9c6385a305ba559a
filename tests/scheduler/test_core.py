"""The scheduler core on its own: progress model, budgets, preemption, aborts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scheduler_svc.core import ConfigError, Event, FinishReason, RequestStatus, SchedulerConfig
from scheduler_svc.core.policy import POLICIES
from tests.scheduler.factories import (
    EOS,
    fake_execute,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
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
        ({"watermark": 0.7}, "watermark must be in [0, 0.5)"),
        ({"policy": "fifo"}, f"policy must be one of {', '.join(POLICIES)}, got 'fifo'"),
        ({"aging_s": 0}, "aging_s and preemption_window_s must be > 0"),
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
    outs = [step(sched) for _ in range(3)]
    assert [o.num_batched_tokens for o in outs] == [16, 16, 8]
    assert [len(o.new) for o in outs] == [1, 0, 0]  # in full once, then as deltas
    assert req.num_output_tokens == 1  # sampled only when the last chunk completed
    assert sched.block_manager.block_table(req.seq_id) == list(range(10))


def test_long_prefill_threshold_caps_one_prompt_per_step():
    sched = make_scheduler(chunk_size=32, max_num_batched_tokens=32, max_num_seqs=4,
                           long_prefill_token_threshold=8)
    sched.add_request(make_request(prompt_len=40))
    assert sched.schedule().num_batched_tokens == 8


def test_decodes_come_first_and_new_requests_join_next_step():
    sched = make_scheduler(chunk_size=10, max_num_batched_tokens=10, max_num_seqs=4)
    a = make_request(prompt_len=8, max_tokens=5)
    sched.add_request(a)
    step(sched)
    b = make_request(prompt_len=20, max_tokens=5)
    sched.add_request(b)
    out = sched.schedule()
    # a decodes (1 token), b gets what is left of the budget (9 of 10)
    assert [(r, n) for r, n, _ in out.scheduled()] == [(b, 9), (a, 1)]
    assert out.cached == [a] and out.new == [(b, 9)]


def test_every_request_completes_and_all_blocks_return():
    sched = make_scheduler(num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    reqs = [make_request(prompt_len=3 + 5 * i, max_tokens=6) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert sched.block_manager.num_free_blocks == 64
    assert not sched.requests


def test_preemption_by_recompute_loses_and_duplicates_nothing():
    def outputs(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, chunk_size=8, max_num_batched_tokens=16,
                               max_num_seqs=8, enable_prefix_caching=False)
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


def test_victim_is_lowest_tier_then_most_recently_admitted():
    sched = make_scheduler(num_blocks=8, block_size=4, chunk_size=8,
                           max_num_batched_tokens=16, max_num_seqs=8)
    premium = make_request(prompt_len=8, max_tokens=20, priority_tier=0)
    old_be = make_request(prompt_len=8, max_tokens=20, priority_tier=2)
    new_be = make_request(prompt_len=8, max_tokens=20, priority_tier=2)
    for r in (premium, old_be):
        sched.add_request(r)
    step(sched)
    sched.add_request(new_be)
    step(sched)  # the pool (8 blocks) is now full: 2 + 2 + 2 blocks + decode growth
    while sched.num_preemptions == 0:
        step(sched)
    assert new_be.num_preemptions == 1
    assert premium.num_preemptions == 0 and old_be.num_preemptions == 0


def test_swap_is_chosen_when_copying_is_cheaper_and_resumes_exactly():
    from scheduler_svc.core import CostModel

    cheap_swap = CostModel(prefill_tokens_per_s=10.0, swap_bytes_per_s=1e9, block_bytes=1000)

    def run(num_blocks, host):
        sched = make_scheduler(num_blocks=num_blocks, num_host_blocks=host, cost=cheap_swap,
                               chunk_size=8, max_num_batched_tokens=16, max_num_seqs=8)
        reqs = [make_request(prompt_len=6, max_tokens=20, request_id=f"s{i}") for i in range(6)]
        for r in reqs:
            sched.add_request(r)
        swaps = []
        while sched.has_work():
            out = step(sched)
            swaps += out.swap_out + out.swap_in
        assert sched.block_manager.num_free_host_blocks == host
        return [r.token_ids for r in reqs], sched.preemptions_by_reason, swaps

    roomy, _, _ = run(256, 0)
    tight, reasons, swaps = run(16, 64)
    assert reasons["kv_full:swap"] > 0 and swaps
    assert tight == roomy


def test_a_sequence_preempted_k_times_is_protected():
    sched = make_scheduler(num_blocks=12, chunk_size=8, max_num_batched_tokens=16,
                           max_num_seqs=8, max_preemptions=2, enable_prefix_caching=False)
    reqs = [make_request(prompt_len=6, max_tokens=30) for _ in range(5)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    assert max(r.num_preemptions for r in reqs) <= 2 + 1  # only forced once all are protected
    assert any(r.protected for r in reqs)


def test_the_kth_preemption_in_the_window_protects_not_the_one_after():
    """The thrash guard as its docstring states it: the max_preemptions-th preemption
    within preemption_window_s protects the sequence, the ones before it do not."""
    sched = make_scheduler(num_blocks=32, max_preemptions=3, enable_prefix_caching=False)
    req = make_request(prompt_len=6, max_tokens=30)
    sched.add_request(req)
    protected_after = []
    for _ in range(3):
        step(sched)  # it runs again (recomputed)
        assert req in sched.running
        sched.lifecycle.preempt(req, "test", allow_swap=False)
        protected_after.append(req.protected)
    assert protected_after == [False, False, True]


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
    sched = make_scheduler(num_blocks=32, enable_prefix_caching=False)
    req = make_request(prompt_len=10, max_tokens=50)
    sched.add_request(req)
    step(sched)
    assert sched.block_manager.num_free_blocks < 32
    event = sched.abort(req.request_id)
    assert event == Event(req, None, FinishReason.ABORT)
    assert sched.abort(req.request_id) is None
    assert sched.block_manager.num_free_blocks == 32
    out = sched.schedule()
    assert out.finished_seq_ids == [req.seq_id] and not out.new and not out.cached


def test_cancel_racing_the_final_step_is_still_an_abort():
    sched = make_scheduler()
    req = make_request(prompt_len=4, max_tokens=1)
    sched.add_request(req)
    out = sched.schedule()  # this step would produce the last token
    sched.abort(req.request_id)
    assert sched.update(out, *fake_execute(out)) == []
    assert req.finish_reason == FinishReason.ABORT


def test_new_executor_recomputes_running_sequences_in_full():
    sched = make_scheduler(num_blocks=32)
    req = make_request(prompt_len=10, max_tokens=50)
    sched.add_request(req)
    for _ in range(3):
        step(sched)
    history = list(req.token_ids)
    sched.attach_executor(sched.model)
    assert req.status == RequestStatus.WAITING and req.num_computed_tokens == 0
    out = sched.schedule()
    assert out.new == [(req, len(history))] and req.num_computed_tokens == len(history)
    assert out.finished_seq_ids == []  # the new executor holds nothing to drop


def test_queue_caps_reject_at_once_with_a_retry_hint():
    from scheduler_svc.core import QueueFull

    sched = make_scheduler(max_num_waiting=3, max_num_waiting_per_tenant=2)
    sched.add_request(make_request(tenant="a"))
    sched.add_request(make_request(tenant="a"))
    with pytest.raises(QueueFull, match="tenant 'a'") as err:
        sched.add_request(make_request(tenant="a"))
    assert err.value.retry_after_s > 0
    sched.add_request(make_request(tenant="b"))
    with pytest.raises(QueueFull, match="queue is full"):
        sched.add_request(make_request(tenant="c"))


def test_admission_guards_explain_what_to_change():
    sched = make_scheduler(num_blocks=10, block_size=4)
    assert "maximum context length is 512 tokens" in sched.admission_problem(500, 100)
    assert "needs 11 KV blocks" in sched.admission_problem(44, 1)
    assert sched.admission_problem(40, 1) is None


def test_reconfigure_between_steps_takes_effect_next_step():
    sched = make_scheduler(chunk_size=16, max_num_batched_tokens=16, max_num_seqs=4)
    sched.add_request(make_request(prompt_len=64))
    assert sched.schedule().num_batched_tokens == 16
    sched.reconfigure(SchedulerConfig(chunk_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                                      watermark=0.0))
    assert sched.schedule().num_batched_tokens == 4

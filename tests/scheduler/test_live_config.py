"""The core under a config changed live (scheduler_svc/admin.py's field-by-field claims).

Lowering max_num_seqs and max_num_batched_tokens below what is running must not
preempt or stall anyone: the running sequences keep decoding (a step may carry one
decode each, more than the new budget, never more than the old one), nobody new is
admitted until they are below the new cap, and everything finishes with the pool whole.
"""

from __future__ import annotations

import dataclasses

from scheduler_svc.core.policy import POLICIES
from tests.scheduler.factories import fake_execute, make_request, make_scheduler


def drain(sched, max_steps: int = 1000) -> list[tuple[int, int, int]]:
    """(running, waiting, batched tokens) after each step until idle."""
    seen = []
    while sched.has_work():
        out = sched.schedule()
        sched.update(out, *fake_execute(out))
        seen.append((len(sched.running), len(sched.waiting), out.num_batched_tokens))
        assert len(seen) < max_steps, "no progress"
    return seen


def test_lowering_limits_below_the_running_count_drains_then_obeys_them():
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=16)
    for _ in range(6):
        sched.add_request(make_request(prompt_len=8, max_tokens=20))
    for _ in range(3):  # all six admitted and decoding
        out = sched.schedule()
        sched.update(out, *fake_execute(out))
    assert len(sched.running) == 6
    sched.reconfigure(dataclasses.replace(sched.config, max_num_seqs=2,
                                          max_num_batched_tokens=2, chunk_size=2))
    late = [make_request(prompt_len=8, max_tokens=3) for _ in range(3)]
    for req in late:
        sched.add_request(req)
    seen = drain(sched)
    assert sched.num_preemptions == 0
    assert all(tokens <= 6 for _, _, tokens in seen), "never more than one decode each"
    first_admission = next(i for i, (running, waiting, _) in enumerate(seen) if waiting < 3)
    assert all(running <= 6 for running, _, _ in seen[:first_admission])
    assert seen[first_admission - 1][0] < 2, "nobody admitted before running < max_num_seqs"
    assert all(running <= 2 and tokens <= 2 for running, _, tokens in seen[first_admission:])
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert all(req.is_finished for req in late)


def test_switching_policy_mid_flight_finishes_everything():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=32, chunk_size=8)
    for _ in range(6):
        sched.add_request(make_request(prompt_len=20, max_tokens=5))
    out = sched.schedule()
    sched.update(out, *fake_execute(out))
    for policy in POLICIES:  # every registered one
        sched.reconfigure(dataclasses.replace(sched.config, policy=policy))
        out = sched.schedule()
        sched.update(out, *fake_execute(out))
        sched.assert_invariants()
    drain(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_reload_under_the_same_policy_keeps_what_it_learned():
    sched = make_scheduler(policy="chunked-slo", tpot_target_standard_ms=50.0)
    policy = sched.policy
    policy.ttft_guard.threshold_s = 0.5  # as if learned from the recent prompts
    sched.reconfigure(dataclasses.replace(sched.config, chunk_size=16))
    assert sched.policy is policy and policy.ttft_guard.threshold_s == 0.5
    assert policy.prefill_cap() == 16  # the new config is the one it reads
    # "chunked" with a TPOT target has always meant the SLO-aware budget.
    sched.reconfigure(dataclasses.replace(sched.config, policy="chunked"))
    assert sched.policy is policy
    sched.reconfigure(dataclasses.replace(sched.config, tpot_target_standard_ms=0.0))
    assert sched.policy.name == "chunked" and sched.policy is not policy

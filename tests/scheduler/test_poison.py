"""Poison requests (Scheduler.step_failed): a request whose steps keep failing is ended
alone with ERROR after ``max_step_failures``; every other request in its batch fails at
most once, runs a step of its own, and produces exactly the tokens of a run without it."""

from __future__ import annotations

import pytest

from scheduler_svc.core import ConfigError, FinishReason, SchedulerConfig
from tests.scheduler.factories import fake_execute, make_request, make_scheduler


def drive(sched, reqs, poisoned=lambda out: False, max_steps: int = 500):
    """The engine loop's protocol, one plan at a time: a step for which ``poisoned(out)``
    holds fails (the executor drops everything: resync); returns (tokens, finishes, outs)."""
    for req in reqs:
        sched.add_request(req)
    tokens = {r.request_id: [] for r in reqs}
    finishes: dict[str, FinishReason] = {}
    outs = []
    while sched.has_work():
        out = sched.schedule()
        sched.assert_invariants(out)
        events = sched.take_events()
        if not out.is_empty:
            outs.append(out)
            if poisoned(out):
                events += sched.step_failed(out, "forward failed: boom")
                sched.resync()
            else:
                events += sched.update(out, *fake_execute(out))
        sched.assert_invariants()
        for req, token, reason, _ in events:
            assert req.request_id not in finishes, "an event after the finish"
            if token is not None:
                tokens[req.request_id].append(token)
            if reason is not None:
                finishes[req.request_id] = reason
        assert len(outs) < max_steps, "no progress"
    return tokens, finishes, outs


def contains(request_id: str):
    return lambda out: any(r.request_id == request_id for r, _, _ in out.scheduled())


def batch(n: int = 5):
    return [make_request(prompt_len=6 + i, max_tokens=6, request_id=f"q{i}") for i in range(n)]


@pytest.mark.parametrize("max_step_failures", [1, 2, 3])
def test_the_poison_request_fails_alone_and_the_others_are_unharmed(max_step_failures):
    baseline, base_finishes, _ = drive(make_scheduler(), batch()[1:])
    sched = make_scheduler(max_step_failures=max_step_failures)
    reqs = batch()
    tokens, finishes, outs = drive(sched, reqs, contains("q0"))
    assert finishes.pop("q0") == FinishReason.ERROR and tokens.pop("q0") == []
    assert "failed" in reqs[0].error and "boom" in reqs[0].error
    assert finishes == base_finishes  # every other request finished as without it
    assert tokens == baseline  # ... with the same tokens (sampling keyed by position)
    failed = [o for o in outs if contains("q0")(o)]
    # The first failure is shared with its batch; the rest are its own, alone.
    assert len(failed) == max(2, max_step_failures)
    for out in failed[1:]:
        assert [r for r, _, _ in out.scheduled()] == [reqs[0]]
    for req in reqs[1:]:
        assert req.error == "" and req.num_failed_steps == 1
    assert not sched.isolating and sched.block_manager.num_free_blocks == 64


def test_suspects_run_one_per_step_then_batch_again():
    sched = make_scheduler()
    reqs = batch(4)
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    assert len(list(out.scheduled())) == 4
    assert sched.step_failed(out, "hang") == []  # a shared failure ends nobody
    sched.resync()
    assert sched.isolating
    solo = []
    for _ in range(4):
        out = sched.schedule()
        sched.assert_invariants(out)
        solo.append([r for r, _, _ in out.scheduled()])
        sched.update(out, *fake_execute(out))
    assert sorted(s[0].request_id for s in solo) == ["q0", "q1", "q2", "q3"]
    assert all(len(s) == 1 for s in solo)
    assert not sched.isolating
    out = sched.schedule()  # all cleared: one batch again
    assert len(list(out.scheduled())) == 4


def test_a_fault_only_its_later_decodes_trigger_is_found_alone():
    """Its solo recompute succeeds and clears it; the next shared failure doubles its steps
    of its own, so its failing decode then runs alone and ends it, and only it."""
    def poisoned(out):
        return any(r.request_id == "q0" and not full and n == 1 and r.num_output_tokens >= 3
                   for r, n, full in out.scheduled())

    reqs = [make_request(prompt_len=6 + i, max_tokens=8, request_id=f"q{i}")
            for i in range(4)]
    baseline, _, _ = drive(make_scheduler(), [make_request(prompt_len=6 + i, max_tokens=8,
                                                           request_id=f"q{i}")
                                              for i in range(1, 4)])
    tokens, finishes, outs = drive(make_scheduler(max_step_failures=2), reqs, poisoned)
    assert finishes.pop("q0") == FinishReason.ERROR
    assert reqs[0].num_failed_steps == 3  # shared, shared, then alone
    assert tokens.pop("q0")[:3] and tokens == baseline
    assert all(finishes[r] == FinishReason.LENGTH for r in ("q1", "q2", "q3"))
    assert all(r.num_failed_steps <= 2 and not r.error for r in reqs[1:])


def test_max_step_failures_must_be_positive():
    with pytest.raises(ConfigError, match="max_step_failures"):
        SchedulerConfig(max_step_failures=0)

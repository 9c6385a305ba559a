"""Overload refused at Submit from measured throughput (core/admission.py), and idle
tenants' state pruned — the scheduler core on a hand-driven clock."""

from __future__ import annotations

import pytest

from scheduler_svc.core import ConfigError, QueueFull, SchedulerConfig
from scheduler_svc.core.admission import MIN_DEPARTURES, ThroughputMeter, overload_refusal
from tests.scheduler.factories import Clock, make_model, make_request, make_scheduler, step

PREMIUM, STANDARD, BEST_EFFORT = 0, 1, 2


def test_the_meter_measures_only_saturated_time():
    meter = ThroughputMeter()
    assert meter.rate is None  # cold: no estimate, the count caps alone apply
    meter.sample(0.0, 0, saturated=False)
    meter.sample(100.0, 5, saturated=True)  # idle before: those 100 s say nothing
    assert meter.rate is None
    meter.sample(110.0, 5 + 20, saturated=True)  # 20 departures in 10 saturated seconds
    assert meter.rate == pytest.approx(2.0)
    assert meter.measured_departures == 20


def test_refusal_needs_a_bound_and_a_measurement():
    assert overload_refusal(STANDARD, 5.0, ahead=100, free_slots=0, rate=None) is None
    assert overload_refusal(STANDARD, 0.0, ahead=100, free_slots=0, rate=1.0) is None
    assert overload_refusal(STANDARD, 5.0, ahead=3, free_slots=4, rate=0.001) is None
    message, retry = overload_refusal(STANDARD, 5.0, ahead=29, free_slots=0, rate=2.0)
    assert "overloaded" in message and "15.0 s" in message
    assert retry == pytest.approx(10.0)  # the backlog beyond the 5 s bound, at 2/s


def _flooded(clock: Clock, **config):
    """A scheduler whose throughput was measured: 2 slots, 3-step requests, one step per
    clock second, with a queue of best-effort requests kept non-empty (one batch: more
    is refused until a rate is measured) while MIN_DEPARTURES+ requests finished."""
    sched = make_scheduler(clock=clock, max_num_seqs=2, max_num_batched_tokens=64, chunk_size=64,
                           max_num_waiting=10_000, **config)
    arrivals = 0
    while sched.num_finished < 2 * MIN_DEPARTURES:
        while len(sched.waiting) < 2:
            arrivals += 1
            sched.add_request(make_request(8, 3, request_id=f"warm{arrivals}",
                                           priority_tier=BEST_EFFORT))
        step(sched)
        clock.now += 1.0
    return sched


def test_a_flood_is_refused_at_once_with_a_retry_hint_and_accepted_work_completes():
    clock = Clock(0.0)
    sched = _flooded(clock)
    rate = sched.admission.throughput.rate
    assert rate == pytest.approx(2 / 3, rel=0.3)  # 2 slots, a request every 3 steps each
    accepted, refused = [], []
    for i in range(100):
        req = make_request(8, 3, request_id=f"flood{i}")
        try:
            sched.add_request(req)
            accepted.append(req)
        except QueueFull as exc:
            refused.append(exc)
    # The standard bound (5 s) at ~0.67/s admits only a few beyond the 4 already queued.
    assert refused and len(accepted) <= 5
    assert all("overloaded" in str(exc) and exc.retry_after_s >= 1.0 for exc in refused)
    # The hint grows with what is queued and is the time until the wait fits again.
    assert refused[-1].retry_after_s < 60.0
    while sched.has_work():
        step(sched)
        clock.now += 1.0
    assert all(req.is_finished for req in accepted)
    sched.add_request(make_request(8, 3, request_id="after"))  # drained: accepted again


def test_lower_tiers_are_refused_first():
    """Best effort counts everything queued ahead of it, standard and premium only their
    own tiers and above: once new best-effort work is refused, the others still get in."""
    sched = _flooded(Clock(0.0))
    queued = len(sched.waiting)
    accepted_be = 0
    for i in range(100):
        try:
            sched.add_request(make_request(8, 3, request_id=f"be{i}", priority_tier=BEST_EFFORT))
            accepted_be += 1
        except QueueFull:
            break
    assert 0 < accepted_be < 100  # up to its 20 s bound, then refused
    sched.add_request(make_request(8, 3, request_id="std", priority_tier=STANDARD))
    sched.add_request(make_request(8, 3, request_id="vip", priority_tier=PREMIUM))
    with pytest.raises(QueueFull):
        sched.add_request(make_request(8, 3, request_id="be-more", priority_tier=BEST_EFFORT))
    for i in range(100):  # standard has its own, tighter bound
        try:
            sched.add_request(make_request(8, 3, request_id=f"std{i}", priority_tier=STANDARD))
        except QueueFull:
            break
    else:
        raise AssertionError("standard was never refused")
    assert len(sched.waiting) == queued + accepted_be + 2 + i


def test_a_cold_server_queues_one_batch_beyond_its_free_slots():
    """Nothing measured: the free slots and one more batch (max_num_seqs) wait, the rest
    is refused at once; with the tier's bound off, only the count caps apply."""
    sched = make_scheduler(clock=Clock(0.0), max_num_seqs=2, max_num_waiting=20)
    for i in range(4):
        sched.add_request(make_request(8, 3, request_id=f"r{i}"))
    with pytest.raises(QueueFull, match="full batch of 2 requests already waits") as exc:
        sched.add_request(make_request(8, 3, request_id="one-too-many"))
    assert exc.value.retry_after_s >= 1.0
    unbounded = make_scheduler(clock=Clock(0.0), max_num_seqs=2, max_num_waiting=20,
                               max_queue_time_standard_s=0.0)
    for i in range(20):
        unbounded.add_request(make_request(8, 3, request_id=f"u{i}"))
    with pytest.raises(QueueFull, match="queue is full"):
        unbounded.add_request(make_request(8, 3, request_id="one-too-many"))


def test_bounds_are_validated():
    with pytest.raises(ConfigError, match="max_queue_time_standard_s"):
        SchedulerConfig(max_queue_time_standard_s=-1)
    with pytest.raises(ConfigError, match="max_queue_time_premium_s"):
        SchedulerConfig(max_queue_time_premium_s=float("nan"))
    disabled = _flooded(Clock(0.0), max_queue_time_standard_s=0)
    for i in range(100):  # 0: no bound for the tier, only the count caps
        disabled.add_request(make_request(8, 3, request_id=f"any{i}"))


def test_idle_tenants_leave_no_state_behind():
    """10,000 unique tenants come and go: the per-tenant dicts stay small, so neither
    memory nor the per-step loop over running tenants grows with the names seen."""
    clock = Clock(0.0)
    sched = make_scheduler(clock=clock, max_num_seqs=8, max_num_batched_tokens=64, chunk_size=64,
                           max_num_waiting=10_000)
    for i in range(10_000):
        sched.add_request(make_request(4, 1, request_id=f"t{i}", tenant=f"tenant-{i}"))
        if i % 8 == 7:
            while sched.has_work():
                step(sched)
            clock.now += 0.1
    while sched.has_work():
        step(sched)
    assert sched.num_finished == 10_000
    assert len(sched.running_set.per_tenant) == 0
    assert sched.waiting.num_tenants == 0
    assert len(sched.waiting.served) <= 64 + 8 * 3  # pruned as Submits arrive
    # A returning tenant is lifted to the floor of those waiting, as before pruning.
    sched.add_request(make_request(4, 1, request_id="again", tenant="tenant-0"))
    assert sched.waiting.served["tenant-0"] >= 0.0


def test_a_queue_whose_head_is_stuck_refuses_newcomers():
    """A prompt as long as the pool stuck at the head of the queue: the departure rate of
    short requests says the queue moves, the head's age says it does not."""
    clock = Clock(0.0)
    sched = make_scheduler(num_blocks=16, block_size=4, clock=clock, max_num_seqs=4,
                           max_num_batched_tokens=64, chunk_size=64)
    runner = make_request(40, 200, request_id="runner")  # holds 10 + growing blocks
    sched.add_request(runner)
    step(sched)
    stuck = make_request(60, 1, request_id="stuck")  # 15 blocks: waits for the runner
    sched.add_request(stuck)
    step(sched)
    clock.now += 5.5  # past the standard bound (5 s), and it has not started
    step(sched)
    assert stuck.status.name == "WAITING"
    with pytest.raises(QueueFull, match="not moving") as refused:
        sched.add_request(make_request(4, 2, request_id="newcomer"))
    assert refused.value.retry_after_s >= 1.0
    # Premium counts only premium ahead of it: its queue is empty, so it gets in.
    sched.add_request(make_request(4, 2, request_id="vip", priority_tier=PREMIUM))


def test_a_request_queued_past_twice_its_bound_is_shed_with_a_retry_hint():
    clock = Clock(0.0)
    sched = make_scheduler(num_blocks=16, block_size=4, clock=clock, max_num_seqs=4,
                           max_num_batched_tokens=64, chunk_size=64)
    sched.add_request(make_request(40, 200, request_id="runner"))
    step(sched)
    stuck = make_request(60, 1, request_id="stuck")
    be = make_request(60, 1, request_id="be", priority_tier=BEST_EFFORT)
    sched.add_request(stuck)
    sched.add_request(be)
    clock.now += 10.5  # past 2 x 5 s (standard); best effort's 2 x 20 s is far off
    out = sched.schedule()
    events = sched.take_events()
    shed = [ev for ev in events if ev[0] is stuck]
    assert shed and shed[0][2] is not None and stuck.is_finished
    assert "overloaded" in stuck.error and stuck.retry_after_s >= 1.0
    assert not be.is_finished and sched.num_shed == 1
    assert "stuck" not in sched.requests
    sched.assert_invariants(out)


def test_only_requests_whose_client_saw_nothing_are_shed():
    from scheduler_svc.core.queue import WaitingQueue

    queue = WaitingQueue(aging_s=10.0)
    fresh = make_request(8, 4, request_id="fresh", arrival_time=0.0)
    preempted = make_request(8, 4, request_id="preempted", arrival_time=0.0)
    preempted.num_preemptions = 1
    continuation = make_request(8, 4, request_id="cont", arrival_time=0.0,
                                num_resumed_output_tokens=3)
    young = make_request(8, 4, request_id="young", arrival_time=50.0)
    queue.push(fresh)
    queue.push(preempted, front=True)
    queue.push(continuation)
    queue.push(young)
    assert queue.overdue(60.0, lambda tier: 20.0) == [fresh]
    assert queue.overdue(60.0, lambda tier: 0.0) == []  # 0: no bound, nobody shed
    assert queue.oldest_arrival_up_to(1) == 0.0 and queue.oldest_arrival_up_to(0) is None


def test_a_server_never_saturated_still_refuses_a_flood_at_once():
    """Requests arrive one at a time and finish (nothing ever waits, so no saturated
    interval is measured); the service times alone say how fast a queue would drain."""
    clock = Clock(0.0)
    sched = make_scheduler(clock=clock, max_num_seqs=2, max_num_batched_tokens=64,
                           chunk_size=64, max_num_waiting=10_000)
    for i in range(2 * MIN_DEPARTURES):
        sched.add_request(make_request(8, 3, request_id=f"calm{i}"))
        while sched.has_work():
            step(sched)
            clock.now += 1.0
    assert sched.admission.throughput.rate is None  # never saturated
    refused = 0
    for i in range(100):
        try:
            sched.add_request(make_request(8, 3, request_id=f"flood{i}"))
        except QueueFull as exc:
            assert "overloaded" in str(exc) and exc.retry_after_s >= 1.0
            refused += 1
    # 2 running at ~3 s each: ~0.67/s, so the 5 s bound holds a handful, not 100.
    assert 80 <= refused < 100


def test_a_burst_into_free_slots_is_not_refused():
    """n = 16 (or 16 clients at once) arriving between two steps, with every slot free:
    they wait only for the next step, however slowly the last requests were served."""
    clock = Clock(0.0)
    sched = make_scheduler(clock=clock, max_num_seqs=64, max_num_batched_tokens=256,
                           chunk_size=256, max_num_waiting=10_000)
    for i in range(2 * MIN_DEPARTURES):  # one at a time, 3 s each: Little says ~0.33/s
        sched.add_request(make_request(8, 3, request_id=f"calm{i}"))
        while sched.has_work():
            step(sched)
            clock.now += 1.0
    for i in range(16):
        sched.add_request(make_request(8, 3, request_id=f"burst{i}"))  # none refused
    step(sched)
    assert len(sched.running) == 16 and not sched.waiting


def test_requests_queued_through_an_executor_restart_are_not_shed_for_it():
    """An executor restart (kill -9, model load) holds the queue; its waits are not load,
    so shedding counts from when the new executor started serving."""
    clock = Clock(0.0)
    sched = make_scheduler(num_blocks=16, block_size=4, clock=clock, max_num_seqs=4,
                           max_num_batched_tokens=64, chunk_size=64)
    sched.add_request(make_request(40, 200, request_id="runner"))
    step(sched)
    queued = make_request(60, 1, request_id="queued")  # waits for the runner's blocks
    sched.add_request(queued)
    sched.detach_executor()
    clock.now += 30.0  # the executor is down far past 2 x 5 s
    sched.attach_executor(make_model(16, 4))
    sched.schedule()
    assert not queued.is_finished and not queued.error


def test_a_burst_into_a_cold_server_is_refused_at_once_from_the_running_budgets():
    """Nothing has finished, so no departure rate was measured; after a few steps the
    running requests' remaining max_tokens and the step time say how fast the queue
    will drain, so a burst past the bound is refused at Submit, not shed later."""
    clock = Clock(0.0)
    sched = make_scheduler(clock=clock, max_num_seqs=4, max_num_batched_tokens=64,
                           chunk_size=64, max_num_waiting=10_000)
    for i in range(4):
        sched.add_request(make_request(8, 20, request_id=f"first{i}"))
    for _ in range(3):  # 0.5 s a step
        step(sched)
        clock.now += 0.5
    assert sched.admission.throughput.rate is None and sched.admission.service.rate() is None
    left = [r.max_tokens - r.num_output_tokens for r in sched.running]
    rate = sched.admission.rate()
    assert rate == pytest.approx(len(left) / (sum(left) / len(left) * 0.5))
    outcomes = []
    for i in range(100):
        try:
            sched.add_request(make_request(8, 20, request_id=f"burst{i}"))
            outcomes.append("accepted")
        except QueueFull as exc:
            assert "overloaded" in str(exc) and exc.retry_after_s >= 1.0
            outcomes.append("refused")
    # No slot free: the k-th newcomer waits (k + 1) / rate; the 5 s bound holds the
    # first int(5 x rate) of them (~0.45/s here: 2), and then nobody else.
    fits = int(5.0 * rate)
    assert fits == 2
    assert outcomes == ["accepted"] * fits + ["refused"] * (100 - fits)


def test_requests_admitted_before_any_estimate_are_judged_again_once_there_is_one():
    """A burst into a server that has run no step yet: its free slots and one batch are
    admitted blind, the rest refused at once. At the first admission step with an
    estimate, the blind ones it would have refused are refused then, with a retry hint,
    instead of being shed after twice their bound; the oldest are kept."""
    clock = Clock(0.0)
    sched = make_scheduler(clock=clock, max_num_seqs=4, max_num_batched_tokens=64,
                           chunk_size=64, max_num_waiting=10_000)
    burst = [make_request(8, 20, request_id=f"blind{i}") for i in range(40)]
    blind = []
    for req in burst:
        try:
            sched.add_request(req)
            blind.append(req)
        except QueueFull:
            pass
    assert len(blind) == 8 and sched.admission.num_blind == 8
    for _ in range(3):
        step(sched)
        clock.now += 0.5
    refused = [r for r in blind if r.is_finished]
    # 4 running with ~18 of 20 tokens left at 0.5 s a step: ~0.45 departures/s, so of
    # the 4 waiting the first 2 start within 5 s; the other 2 are refused.
    assert len(refused) == 2 and sched.admission.num_blind == 0
    assert all("overloaded" in r.error and r.retry_after_s >= 1.0 for r in refused)
    kept = [r for r in blind if not r.is_finished]
    assert max(blind.index(r) for r in kept) < min(blind.index(r) for r in refused)

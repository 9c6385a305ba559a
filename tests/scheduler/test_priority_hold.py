"""Priority holds when the batch is full (core/priority_hold.py): a premium
request preempts the worst running best-effort sequence instead of waiting for one to
finish, within the thrash guard, and the preempted ones finish with the same tokens."""

from __future__ import annotations

from tests.scheduler.factories import (
    TICKING_CLOCK_CONFIG,
    Clock,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

PREMIUM, BEST_EFFORT = 0, 2


def _sched(**kw):
    # A clock that stands still: nobody ages into starving while the flood runs.
    return make_scheduler(clock=Clock(0.0), **{**TICKING_CLOCK_CONFIG, **kw})


def _flood(n, max_tokens=40, prompt_len=8):
    return [make_request(prompt_len, max_tokens, request_id=f"be{i}", priority_tier=BEST_EFFORT,
                         tenant="bulk") for i in range(n)]


def _premium_ttft_steps(sched, vip, limit=200):
    """Steps from ``vip``'s arrival to its first output token."""
    sched.add_request(vip)
    for n in range(1, limit):
        step(sched)
        if vip.num_output_tokens:
            return n
    raise AssertionError("the premium request never got a token")


def _outputs(reqs):
    return {r.request_id: list(r.token_ids[r.num_prompt_tokens:]) for r in reqs}


def _baseline(n, max_tokens=40, prompt_len=8, **kw):
    sched = _sched(**kw)
    flood = _flood(n, max_tokens, prompt_len)
    for r in flood:
        sched.add_request(r)
    run_to_completion(sched)
    return _outputs(flood)


def test_premium_starts_within_a_step_when_best_effort_fills_every_slot():
    sched = _sched(num_blocks=256, max_num_seqs=4)
    flood = _flood(8)
    for r in flood:
        sched.add_request(r)
    for _ in range(5):  # every slot decoding a best-effort answer, four more waiting
        step(sched)
    assert len(sched.running) == 4 and all(r.num_output_tokens for r in sched.running)
    vip = make_request(8, 4, request_id="vip", priority_tier=PREMIUM, tenant="gold")
    sched.add_request(vip)
    out = step(sched)
    assert vip in [r for r, _ in out.new], "premium waited for a free slot"
    assert sched.preemptions_by_reason["priority:recompute"] == 1
    # Its first token comes from the step that prefilled it: TTFT of one step, not the
    # remaining ~35 steps of a best-effort answer.
    assert vip.num_output_tokens == 1
    run_to_completion(sched)
    assert vip.is_finished and vip.num_output_tokens == 4
    assert all(r.is_finished for r in flood)
    assert _outputs(flood) == _baseline(8, num_blocks=256, max_num_seqs=4)


def test_a_stream_of_premium_requests_keeps_a_bounded_ttft_under_the_flood():
    sched = _sched(num_blocks=256, max_num_seqs=4)
    flood = _flood(12, max_tokens=60)
    for r in flood:
        sched.add_request(r)
    for _ in range(3):
        step(sched)
    ttfts = []
    for i in range(5):
        vip = make_request(8, 3, request_id=f"vip{i}", priority_tier=PREMIUM, tenant="gold")
        ttfts.append(_premium_ttft_steps(sched, vip))
    assert max(ttfts) <= 2, ttfts
    run_to_completion(sched)
    assert all(r.is_finished and r.num_output_tokens == 60 for r in flood)


def test_premium_preempts_for_kv_when_the_pool_is_full():
    # Slots to spare, but best-effort answers hold most of the 32-block pool.
    kw = dict(num_blocks=32, block_size=4, max_num_seqs=8, enable_prefix_caching=False)
    sched = _sched(**kw)
    flood = _flood(4, max_tokens=16, prompt_len=16)
    for r in flood:
        sched.add_request(r)
    for _ in range(6):
        step(sched)
    assert sched.block_manager.num_free_blocks == 8
    vip = make_request(32, 2, request_id="vip", priority_tier=PREMIUM, tenant="gold")
    # The step it arrives in admission finds it no KV (and records its need); the next
    # step preempts for it before the decodes and starts it.
    assert _premium_ttft_steps(sched, vip) <= 2
    assert sched.preemptions_by_reason["priority:recompute"] >= 1
    run_to_completion(sched)
    assert vip.is_finished
    assert _outputs(flood) == _baseline(4, prompt_len=16, max_tokens=16, **kw)


def test_no_preemption_for_the_same_tier_nor_of_a_protected_sequence():
    sched = _sched(num_blocks=256, max_num_seqs=2)
    flood = _flood(2)
    for r in flood:
        sched.add_request(r)
    for _ in range(3):
        step(sched)
    same = make_request(8, 2, request_id="same-tier", priority_tier=BEST_EFFORT)
    sched.add_request(same)
    step(sched)
    assert sched.num_preemptions == 0 and same.num_output_tokens == 0
    for r in flood:  # the thrash guard: preempted too often already
        r.protected = True
    vip = make_request(8, 2, request_id="vip", priority_tier=PREMIUM)
    sched.add_request(vip)
    step(sched)
    assert sched.num_preemptions == 0 and vip.num_output_tokens == 0
    run_to_completion(sched)
    assert vip.is_finished and same.is_finished


def test_static_policy_batches_are_not_broken_into():
    sched = _sched(num_blocks=256, max_num_seqs=2, policy="static")
    for r in _flood(2):
        sched.add_request(r)
    step(sched)
    sched.add_request(make_request(8, 2, request_id="vip", priority_tier=PREMIUM))
    for _ in range(5):
        step(sched)
    assert sched.num_preemptions == 0


def test_through_the_simulator_premium_ttft_stays_short_under_a_best_effort_flood():
    """Simulated time (10 ms a step): without priority hold the premium TTFTs are
    2.8-3.7 s (each waits for a 400-token best-effort answer to end); with it, a few
    steps."""
    from sim.engine import Simulation, policy_config
    from sim.workload import TraceRequest
    from tests.sim.test_engine import LinearCost

    flood = [TraceRequest(0.0, 32, 400, "bulk", BEST_EFFORT, "bulk") for _ in range(8)]
    vips = [TraceRequest(0.5 + 0.3 * i, 32, 8, "vip", PREMIUM, "gold") for i in range(4)]
    res = Simulation(flood + vips, policy_config("chunked", max_num_seqs=4),
                     LinearCost()).run()
    ttfts = [r.first_token_s - r.arrival_s for r in res.records if r.priority_tier == PREMIUM]
    assert len(ttfts) == 4 and max(ttfts) < 0.1, ttfts
    bulk = [r for r in res.records if r.priority_tier == BEST_EFFORT]
    assert [r.num_output_tokens for r in bulk] == [400] * 8

"""The SLO-aware token budget (scheduler_svc/core/step_cost.py): an online fit of step
time, and a chunked policy that sizes each step's prompt work to hold a TPOT target.

The executor here is a stand-in whose step time is a known linear function of the plan
(what the fit must recover), so the tests check the budget's arithmetic and the
scheduler's use of it, not a machine's speed."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.core import ConfigError, SchedulerConfig, step_cost
from scheduler_svc.core.step_cost import MIN_PREFILL_TOKENS, StepCost, TtftGuard
from tests.scheduler.factories import fake_execute, make_request, make_scheduler

# The stand-in executor: 20 ms per step, 0.1 ms per decode, 0.05 ms per prompt token.
A, B, C = 20.0, 0.1, 0.05


def _step_ms(decodes: int, prefill: int) -> float:
    return A + B * decodes + C * prefill


def _trained(noise: float = 0.0, seed: int = 0) -> StepCost:
    rng, cost = random.Random(seed), StepCost()
    for _ in range(400):
        d, p = rng.randrange(0, 128), rng.choice((0, 0, rng.randrange(1, 2048)))
        cost.observe(d, p, 0, _step_ms(d, p) + rng.gauss(0, noise))
    return cost


def test_the_fit_recovers_a_linear_step_time():
    cost = _trained()
    assert cost.ready
    for d, p in ((1, 0), (64, 512), (128, 2000)):
        assert cost.predict_ms(d, p, 0) == pytest.approx(_step_ms(d, p), rel=1e-3)


def test_one_outlier_step_does_not_move_the_budget():
    cost = _trained(noise=0.5)
    before = cost.prefill_limit(60.0, 32, 0, 4096)
    cost.observe(32, 0, 0, 5000.0)  # a 5 s stall: a GC pause, a page fault
    after = cost.prefill_limit(60.0, 32, 0, 4096)
    assert abs(after - before) <= 0.05 * before


def test_the_limit_holds_the_target_and_shrinks_as_decodes_grow():
    cost = _trained()
    limits = [cost.prefill_limit(60.0, d, 0, 4096) for d in (1, 64, 256)]
    assert limits[0] > limits[1] > limits[2] >= MIN_PREFILL_TOKENS
    for d, limit in zip((1, 64, 256), limits, strict=True):
        assert _step_ms(d, limit) <= 60.0 + 1e-6
        assert _step_ms(d, limit + 40) > 60.0  # and spends what is there (within the margin)
    # Decodes alone past the target: prompts still progress by the floor, never starve.
    assert cost.prefill_limit(20.5, 256, 0, 4096) == MIN_PREFILL_TOKENS
    assert cost.prefill_limit(1000.0, 1, 0, 700) == 700  # never past the step's ceiling


def test_no_limit_before_the_fit_has_seen_prompt_work():
    cost = StepCost()
    for _ in range(100):
        cost.observe(8, 0, 0, _step_ms(8, 0))
    assert not cost.ready and cost.prefill_limit(60.0, 8, 0, 4096) is None


def _drive(sched, steps: int) -> list:
    """Steps the core with the stand-in executor; each answered step is observed."""
    outs = []
    for _ in range(steps):
        out = sched.schedule()
        decodes = out.num_batched_tokens - out.num_prefill_tokens
        sched.update(out, *fake_execute(out))
        sched.observe_step(out, _step_ms(decodes, out.num_prefill_tokens) / 1e3)
        outs.append(out)
    return outs


def test_the_chunked_policy_holds_the_tightest_running_tiers_target():
    sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=4096,
                           max_num_seqs=128, chunk_size=256, async_scheduling=False,
                           tpot_target_premium_ms=60.0, tpot_target_standard_ms=120.0)
    for i in range(100):  # a running crowd of decodes (premium), warming the fit up
        sched.add_request(make_request(prompt_len=64 + i, max_tokens=400, priority_tier=0,
                                       request_id=f"d{i}"))
        _drive(sched, 1)
    assert sched.step_cost.ready
    sched.add_request(make_request(prompt_len=6000, max_tokens=4, priority_tier=1))
    outs = _drive(sched, 40)
    with_prompt = [o for o in outs if o.num_prefill_tokens]
    assert with_prompt
    for o in with_prompt:  # the premium target (the tightest running) holds
        assert _step_ms(o.num_batched_tokens - o.num_prefill_tokens,
                        o.num_prefill_tokens) <= 60.0 + 1.0
    # ...and the step spends the room it has: far more than the 256-token chunk.
    assert max(o.num_prefill_tokens for o in with_prompt) > 256


def test_without_decodes_a_prompt_takes_the_whole_budget():
    sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=2048,
                           chunk_size=256, async_scheduling=False, tpot_target_standard_ms=30.0)
    sched.step_cost = _trained()
    sched.add_request(make_request(prompt_len=4000, max_tokens=2))
    first = sched.schedule()
    assert first.num_prefill_tokens == 2048  # nothing decodes: spare time goes to prefill


def test_the_ttft_guard_boosts_only_the_tail_and_at_most_its_ration():
    guard = TtftGuard()
    assert not any(guard.boost(1e9) for _ in range(1000))  # no TTFTs seen: no threshold
    for i in range(100):
        guard.prompt_done(i / 100)  # waits 0.00 .. 0.99 s: p95 ~0.94 s
    assert 0.9 <= guard.threshold_s <= 0.99
    assert not any(guard.boost(0.5) for _ in range(1000))  # a normal wait: never
    boosts = sum(guard.boost(5.0) for _ in range(10 * step_cost.BOOST_EVERY_STEPS))
    # The saved-up credit plus one per BOOST_EVERY_STEPS steps, never more.
    assert 10 <= boosts <= 10 + step_cost.MAX_BOOST_CREDIT


def test_a_prompt_waiting_into_the_tail_gets_a_whole_budget_step():
    sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=4096,
                           max_num_seqs=128, chunk_size=256, async_scheduling=False,
                           tpot_target_standard_ms=40.0)
    for i in range(60):
        sched.add_request(make_request(prompt_len=64 + i, max_tokens=400, request_id=f"d{i}"))
        _drive(sched, 1)
    assert sched.step_cost.ready
    sched.policy.ttft_guard.threshold_s = 0.5  # as if the recent prompts' p95 wait were 0.5 s
    sched.policy.ttft_guard.credit = 1.0
    late = make_request(prompt_len=3000, max_tokens=4, request_id="late",
                        arrival_time=sched.clock() - 10.0)
    sched.add_request(late)
    out = _drive(sched, 1)[0]
    decodes = out.num_batched_tokens - out.num_prefill_tokens
    assert late.num_output_tokens == 1  # the whole prompt in one step (less its cached
    assert out.num_prefill_tokens > 2500  # prefix), past the 40 ms target
    assert _step_ms(decodes, out.num_prefill_tokens) > 40.0
    assert sched.policy.ttft_guard.num_boosts == 1
    nxt = _drive(sched, 1)[0]  # the ration is spent: the target holds again
    assert _step_ms(nxt.num_batched_tokens - nxt.num_prefill_tokens,
                    nxt.num_prefill_tokens) <= 40.0 + 1.0


def test_targets_are_validated_with_a_message():
    with pytest.raises(ConfigError, match="tpot_target_standard_ms must be a number of "
                                          "milliseconds >= 0"):
        SchedulerConfig(tpot_target_standard_ms=-5)


def test_other_policies_ignore_the_target():
    sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=2048,
                           policy="continuous", async_scheduling=False,
                           tpot_target_premium_ms=25.0)
    sched.step_cost = _trained()
    for i in range(8):
        sched.add_request(make_request(prompt_len=16, max_tokens=50, priority_tier=0,
                                       request_id=f"d{i}"))
    _drive(sched, 3)
    sched.add_request(make_request(prompt_len=3000, max_tokens=2, priority_tier=0))
    out = sched.schedule()
    assert out.num_prefill_tokens == 2048 - 8

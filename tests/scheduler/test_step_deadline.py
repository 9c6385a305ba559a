"""The step deadline (scheduler_svc/step_deadline.py): a hang is called within
max(1 s, 3 × p99 step time) once steps were measured, a step's planned work stretches
its own deadline, and an executor's first steps get the old cold floor."""

from __future__ import annotations

import pytest

from scheduler_svc import step_deadline as sd
from scheduler_svc.step_deadline import StepDeadlines


def warmed(step_s: float, num_tokens: int = 16, steps: int = 50,
           rate: float = 1000.0) -> StepDeadlines:
    d = StepDeadlines()
    d.reset(rate)
    for _ in range(steps):
        d.observe(step_s, num_tokens)
    return d


def test_an_executor_s_first_steps_get_the_cold_floor():
    d = StepDeadlines()
    d.reset(1000.0)
    assert d.deadline(16) == pytest.approx(sd.COLD_FLOOR_S + sd.COLD_FACTOR * 16 / 1e3)
    for _ in range(sd.WARMUP_STEPS - 1):
        d.observe(0.01, 16)
    assert d.deadline(16) == pytest.approx(sd.COLD_FLOOR_S + sd.COLD_FACTOR * 0.01)
    assert d.deadline(100_000) == pytest.approx(
        sd.COLD_FLOOR_S + sd.COLD_FACTOR * (0.01 + (100_000 - 16) / 1e3))
    assert d.limit(16) == pytest.approx(sd.LIMIT_FACTOR * d.deadline(16))
    d.observe(0.01, 16)
    assert d.warm and d.deadline(16) == sd.FLOOR_S


def test_fast_steps_give_the_one_second_floor_and_slow_ones_three_times_their_p99():
    assert warmed(0.02).deadline(16) == sd.FLOOR_S
    slow = warmed(0.5)
    assert slow.deadline(16) == pytest.approx(3 * 0.5)
    # One slow step in a hundred sets the p99, so a rare slow step is not a hang either.
    mixed = warmed(0.05, steps=99)
    mixed.observe(0.8, 16)
    assert mixed.p99_step_s() == 0.8
    assert mixed.deadline(16) == pytest.approx(3 * 0.8)


def test_a_long_prefill_stretches_its_own_deadline():
    d = warmed(0.05)
    assert d.deadline(4096) == pytest.approx(3 * (0.05 + (4096 - 16) / 1000.0))
    assert d.deadline(4096) > d.deadline(16)


def test_the_measured_prefill_cost_replaces_the_hello_s_once_seen():
    d = warmed(0.05)
    for _ in range(10):
        d.observe(1.0, 256)  # 4 ms a token, 4x what the Hello said
    assert d.deadline(2048) >= 3 * (2048 - 256) * 0.004
    quick = warmed(0.05, rate=10.0)  # a warm-up measured on a busy machine: 100 ms a token
    for _ in range(4):
        quick.observe(0.256, 256)  # 1 ms a token in fact
    assert quick.deadline(1024) < 3 * 1024 * 0.01
    d.reset(1000.0)  # a new executor: its own times only
    assert not d.warm and d.deadline(16) == pytest.approx(sd.COLD_FLOOR_S + 0.064)


def test_an_executor_that_measured_nothing_is_given_a_slow_rate():
    d = warmed(0.05, rate=0.0)
    assert d.deadline(100) == pytest.approx(3 * (0.05 + 84 / sd.DEFAULT_TOKENS_PER_S))


def test_a_few_big_steps_do_not_stretch_every_deadline():
    d = warmed(0.05, steps=40)
    for _ in range(5):
        d.observe(3.0, 800)  # a takeover's recompute: 3.75 ms a token
    assert d.p99_step_s() == 0.05  # the p99 of decode-like steps
    assert d.deadline(16) == sd.FLOOR_S
    assert d.deadline(816) == pytest.approx(3 * (0.05 + 800 * 3.0 / 800))

"""Metric definitions against examples computed by hand (vllm bench serve's)."""

from __future__ import annotations

import math

import pytest

from sim.metrics import percentile, summarize, tpot


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input; between 2 and 3
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)  # rank 3.6
    assert percentile([10, 20, 30, 40, 50], 0) == 10
    assert percentile([10, 20, 30, 40, 50], 100) == 50
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1, 2], 101)


# A: arrives at 0, tokens at 0.5, 1.0, 1.5, 2.0, 2.5 s (5 tokens).
# B: arrives at 1.0, its only token at 1.2 s.
A = (0.0, 0.5, 2.5, 5, [0.5, 1.0, 1.5, 2.0, 2.5])
B = (1.0, 1.2, 1.2, 1, [1.2])


def test_summary_of_two_requests():
    s = summarize([A, B])
    # TTFT 500 and 200 ms; E2E 2,500 and 200 ms.
    assert s["ttft_mean_ms"] == pytest.approx(350)
    assert s["ttft_median_ms"] == pytest.approx(350)
    assert s["ttft_p99_ms"] == pytest.approx(200 + 0.99 * 300)
    assert s["e2e_mean_ms"] == pytest.approx(1350)
    # TPOT = (E2E − TTFT) ÷ (tokens − 1) = 2,000 ÷ 4; B has one token: no TPOT.
    assert s["tpot_mean_ms"] == pytest.approx(500)
    assert s["tpot_p99_ms"] == pytest.approx(500)
    # ITL: A's four gaps of 500 ms; B has no gap.
    assert s["itl_median_ms"] == pytest.approx(500)
    # Duration: first arrival (0) to last finish (2.5 s).
    assert s["duration_s"] == pytest.approx(2.5)
    assert s["request_throughput"] == pytest.approx(2 / 2.5)
    assert s["output_throughput"] == pytest.approx(6 / 2.5)
    assert s["completed"] == 2


def test_given_duration_sets_the_throughputs():
    s = summarize([A, B], duration_s=10.0)
    assert s["output_throughput"] == pytest.approx(0.6)
    assert s["request_throughput"] == pytest.approx(0.2)


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT SLO 300 ms: only B (200 ms) meets it.
    s = summarize([A, B], slo_ttft_ms=300)
    assert s["goodput"] == pytest.approx(1 / 2.5)
    assert s["goodput_fraction"] == pytest.approx(0.5)
    # TPOT SLO 400 ms: A (500 ms) misses; B has no TPOT and meets any TPOT SLO.
    assert summarize([A, B], slo_tpot_ms=400)["goodput_fraction"] == pytest.approx(0.5)
    # Loose SLOs: both.
    s = summarize([A, B], slo_ttft_ms=1000, slo_tpot_ms=600, slo_e2e_ms=3000)
    assert s["goodput_fraction"] == pytest.approx(1.0)
    assert summarize([A, B], slo_e2e_ms=1000)["goodput_fraction"] == pytest.approx(0.5)


def test_token_times_are_optional():
    s = summarize([A[:4], B[:4]], percentiles=(50, 95))
    assert math.isnan(s["itl_mean_ms"])
    assert s["ttft_p95_ms"] == pytest.approx(200 + 0.95 * 300)
    assert s["tpot_median_ms"] == pytest.approx(500)


def test_no_requests_gives_nans_not_errors():
    s = summarize([])
    assert s["completed"] == 0
    assert math.isnan(s["ttft_p99_ms"])


def test_tpot_is_the_mean_gap_after_the_first_token():
    """The one TPOT definition (sim.metrics.tpot), as summarize() and every table use it."""
    assert tpot(0.5, 2.5, 5) == pytest.approx(0.5)  # request A: (2.5 - 0.5) / 4
    assert tpot(0.2, 0.2, 1) is None  # one token: no gap, no TPOT
    assert tpot(0.2, 0.2, 0) is None
    assert summarize([A, B])["tpot_mean_ms"] == pytest.approx(tpot(0.5, 2.5, 5) * 1e3)


def test_cost_per_million_output_tokens():
    from sim.metrics import cost_per_million

    # The simulated 4xA100 spot node, $8.20/h, at 8,000 output tokens/s: $0.285 per 1M.
    assert abs(cost_per_million(8000.0, 8.20) - 8.20 / 3600 / 8000 * 1e6) < 1e-12
    assert round(cost_per_million(8000.0, 8.20), 3) == 0.285
    assert math.isnan(cost_per_million(0.0, 8.20))

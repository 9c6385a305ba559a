"""`continuum bench` workloads: arrivals, length mixes, tenants/tiers, cancellations,
shared prefixes and trace replay are what the flags say, and bad flags are one clear error."""

from __future__ import annotations

import argparse
import math
import statistics

import pytest

from continuum.bench.clients import Outcome
from continuum.bench.report import summarize_outcomes
from continuum.bench.run import add_arguments, validate_args
from continuum.bench.workload import TOKEN_ID_RANGE, BenchError, build_workload


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_poisson_arrivals_have_the_requested_rate():
    a = args("--num-prompts", "4000", "--request-rate", "5", "--seed", "3")
    specs = build_workload(a, a.request_rate)
    gaps = [b.arrival_s - x.arrival_s for x, b in zip(specs, specs[1:], strict=False)]
    assert specs[0].arrival_s == 0
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.08)


def test_burstiness_widens_the_gaps_at_the_same_rate():
    smooth = args("--num-prompts", "4000", "--request-rate", "5", "--burstiness", "0.25")
    bursty = args("--num-prompts", "4000", "--request-rate", "5", "--burstiness", "4")

    def cv(a):
        specs = build_workload(a, a.request_rate)
        gaps = [b.arrival_s - x.arrival_s for x, b in zip(specs, specs[1:], strict=False)]
        return statistics.mean(gaps), statistics.stdev(gaps) / statistics.mean(gaps)

    (smooth_mean, smooth_cv), (bursty_mean, bursty_cv) = cv(smooth), cv(bursty)
    assert smooth_mean == pytest.approx(0.2, rel=0.06)
    assert bursty_mean == pytest.approx(0.2, rel=0.15)
    # gamma with shape 1/B: coefficient of variation sqrt(B).
    assert smooth_cv == pytest.approx(0.5, rel=0.1)
    assert bursty_cv == pytest.approx(2.0, rel=0.15)


def test_infinite_rate_sends_everything_at_once_and_fixed_lengths_hold():
    a = args("--num-prompts", "10", "--input-len", "33", "--output-len", "7")
    specs = build_workload(a, math.inf)
    assert {s.arrival_s for s in specs} == {0.0}
    assert {len(s.prompt_ids) for s in specs} == {33} and {s.max_tokens for s in specs} == {7}
    assert all(TOKEN_ID_RANGE[0] <= t < TOKEN_ID_RANGE[1] for s in specs for t in s.prompt_ids)


def test_tenants_tiers_cancellations_and_shared_prefix():
    a = args("--num-prompts", "3000", "--tenants", "a:3,b:1", "--tiers", "0:1,2:1",
             "--cancel-fraction", "0.3", "--shared-prefix-len", "20", "--input-len", "50",
             "--output-len", "10", "--long-prompt-fraction", "0.1", "--long-prompt-len", "400")
    specs = build_workload(a, math.inf)
    share_a = sum(s.tenant == "a" for s in specs) / len(specs)
    assert share_a == pytest.approx(0.75, abs=0.03)
    assert {s.tier for s in specs} == {0, 2}
    cancelled = [s for s in specs if s.cancel_after is not None]
    assert len(cancelled) / len(specs) == pytest.approx(0.3, abs=0.03)
    assert all(1 <= s.cancel_after < s.max_tokens for s in cancelled)
    prefix = specs[0].prompt_ids[:20]
    assert all(s.prompt_ids[:20] == prefix for s in specs)
    long_share = sum(len(s.prompt_ids) == 400 for s in specs) / len(specs)
    assert long_share == pytest.approx(0.1, abs=0.02)
    assert {len(s.prompt_ids) for s in specs} == {50, 400}


def test_same_seed_same_workload_different_seed_different():
    a, b, c = (args("--num-prompts", "20", "--request-rate", "2", "--seed", seed)
               for seed in ("1", "1", "2"))
    first, again, other = (build_workload(x, 2.0) for x in (a, b, c))
    assert [s.prompt_ids for s in first] == [s.prompt_ids for s in again]
    assert [s.arrival_s for s in first] == [s.arrival_s for s in again]
    assert [s.arrival_s for s in first] != [s.arrival_s for s in other]


def test_trace_lengths_are_scaled_and_replay_keeps_arrival_times(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                     "10.0,400,80\n10.5,1000,20\n12.0,4000,600\n")
    replay = args("--dataset", "replay", "--trace", str(trace), "--num-prompts", "3",
                  "--length-scale", "0.5", "--time-scale", "2", "--max-input-len", "1500")
    specs = build_workload(replay, 1.0)
    assert [s.arrival_s for s in specs] == [0.0, 1.0, 4.0]
    assert [len(s.prompt_ids) for s in specs] == [200, 500, 1500]  # 2000 clipped
    assert [s.max_tokens for s in specs] == [40, 10, 300]
    sampled = build_workload(args("--dataset", "azure", "--trace", str(trace),
                                  "--num-prompts", "50", "--length-scale", "1"), 1.0)
    assert {len(s.prompt_ids) for s in sampled} <= {400, 1000, 2048}


@pytest.mark.parametrize("argv,words", [
    (("--num-prompts", "0"), "--num-prompts"),
    (("--request-rate", "0"), "--request-rate"),
    (("--cancel-fraction", "1.5"), "--cancel-fraction"),
    (("--max-concurrency", "0"), "--max-concurrency"),
    (("--plot", "x.png"), "--sweep-rates"),
])
def test_bad_flags_are_one_clear_error(argv, words):
    with pytest.raises(BenchError) as caught:
        validate_args(args(*argv))
    assert words in str(caught.value)


def test_bad_weights_and_missing_trace_are_clear(tmp_path):
    with pytest.raises(BenchError, match="--tiers"):
        build_workload(args("--tiers", "5:1"), 1.0)
    with pytest.raises(BenchError, match="--tenants"):
        build_workload(args("--tenants", "a:0"), 1.0)
    with pytest.raises(BenchError, match="no such file"):
        build_workload(args("--dataset", "azure", "--trace", str(tmp_path / "nope.csv")), 1.0)


def test_report_groups_by_tier_and_tenant_and_counts_errors():
    def done(i, tier, tenant, ttft):
        o = Outcome(i, tenant, tier, 10, 3, sent_s=0.0, first_token_s=ttft,
                    finish_s=ttft + 0.2, output_tokens=3)
        o.chunk_times = [ttft, ttft + 0.1, ttft + 0.2]
        return o

    outcomes = [done(0, 0, "a", 0.1), done(1, 2, "b", 0.5),
                Outcome(2, "b", 2, 10, 3, sent_s=0.0, status="refused", code="RESOURCE_EXHAUSTED"),
                Outcome(3, "a", 0, 10, 3, sent_s=0.0, first_token_s=0.1, status="cancelled")]
    report = summarize_outcomes(outcomes, duration_s=2.0, slos={"ttft": 200})
    overall = report["overall"]
    assert overall["num_completed"] == 2 and overall["num_cancelled"] == 1
    assert overall["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert overall["output_throughput"] == pytest.approx(3.0)
    assert overall["goodput"] == pytest.approx(0.5)  # only the 100 ms TTFT meets 200 ms
    assert report["by_tier"]["premium"]["ttft_median_ms"] == pytest.approx(100)
    assert report["by_tier"]["best_effort"]["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert report["by_tenant"]["a"]["num_cancelled"] == 1
    assert overall["tpot_median_ms"] == pytest.approx(100)

"""benchmarks/bench_policies.py: every policy serves the same requests, and the table says
how many each completed (an overloaded server's refusals once made the policies'
throughputs count different work)."""

from __future__ import annotations

from benchmarks import bench_policies
from continuum.cli import build_parser
from continuum.serve.config import Configs
from scheduler_svc.core.config import QUEUE_TIME_FIELDS, TPOT_TARGET_FIELDS


def _scheduler(policy: str, argv: list[str]):
    """What serve hands its scheduler under the benchmark's flags."""
    parser, _ = build_parser()
    engine = bench_policies.engine_args(policy, bench_policies.parse_args(argv))
    args = parser.parse_args(["serve", "--policy", policy, "--telemetry-dsn", "off", *engine])
    return Configs.of(args, ipc="ipc:///tmp/x.sock", model_name="m").scheduler.core


def test_the_servers_run_without_a_queue_time_bound_by_default():
    for policy in bench_policies.POLICIES:
        core = _scheduler(policy, [])
        assert [getattr(core, f) for f in QUEUE_TIME_FIELDS] == [0.0] * 3
        assert (core.tpot_target_standard_ms > 0) == (policy == "chunked-slo")


def test_a_bound_given_reaches_every_tier():
    core = _scheduler("chunked", ["--queue-time-bound-s", "5"])
    assert [getattr(core, f) for f in QUEUE_TIME_FIELDS] == [5.0] * 3
    assert [getattr(core, f) for f in TPOT_TARGET_FIELDS] == [0.0] * 3


def test_the_table_shows_how_many_requests_each_policy_completed():
    row = {"num_completed": 19, "num_requests": 40, "output_throughput": 28.2,
           "ttft_median_ms": 8322, "ttft_p99_ms": 13110, "tpot_median_ms": 141,
           "tpot_p99_ms": 463, "itl_p99_ms": 587, "stalled_share": 0.24,
           "stalled_prefill_tokens_mean": 133}
    table = bench_policies.format_table({"chunked-slo": row}).splitlines()
    assert "done" in table[0].split()
    assert table[1].split()[:3] == ["chunked-slo", "19/40", "28.2"]

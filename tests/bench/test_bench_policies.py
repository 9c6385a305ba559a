"""benchmarks/bench_policies.py: every policy serves the same requests, and the table says
how many each completed (an overloaded server's refusals once made the policies'
throughputs count different work)."""

from __future__ import annotations

from benchmarks import bench_policies
from continuum.cli import build_parser
from continuum.serve_argv import queue_time_flags


def _serve_args(policy: str, argv: list[str]):
    parser, _ = build_parser()
    engine = bench_policies.engine_args(policy, bench_policies.parse_args(argv))
    return parser.parse_args(["serve", "--policy", policy, *engine])


def test_the_servers_run_without_a_queue_time_bound_by_default():
    for policy in bench_policies.POLICIES:
        args = _serve_args(policy, [])
        flags = queue_time_flags(args)  # what serve hands its scheduler
        for tier in ("premium", "standard", "best-effort"):
            assert flags[flags.index(f"--max-queue-time-{tier}-s") + 1] == "0.0"
        assert ("--tpot-target-standard-ms" in flags) == (policy == "chunked-slo")


def test_a_bound_given_reaches_every_tier():
    flags = queue_time_flags(_serve_args("chunked", ["--queue-time-bound-s", "5"]))
    assert [flags[i + 1] for i, f in enumerate(flags) if f.startswith("--max-queue")] == \
        ["5.0"] * 3


def test_the_table_shows_how_many_requests_each_policy_completed():
    row = {"num_completed": 19, "num_requests": 40, "output_throughput": 28.2,
           "ttft_median_ms": 8322, "ttft_p99_ms": 13110, "tpot_median_ms": 141,
           "tpot_p99_ms": 463, "itl_p99_ms": 587, "stalled_share": 0.24,
           "stalled_prefill_tokens_mean": 133}
    table = bench_policies.format_table({"chunked-slo": row}).splitlines()
    assert "done" in table[0].split()
    assert table[1].split()[:3] == ["chunked-slo", "19/40", "28.2"]

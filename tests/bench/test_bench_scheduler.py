"""The scheduler benchmark's modes produce the workload they describe (figures are not
asserted: speed is for the benchmark to print, not for a test to time)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from benchmarks import bench_scheduler, scheduler_steps

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def test_the_mixed_workload_admits_finishes_and_hits_the_prefix_cache():
    r = bench_scheduler.bench(32, 40)
    assert r["running"] >= 28  # admission keeps the running set (nearly) full
    assert r["tokens_per_step"] > 32  # decodes plus prefill chunks
    assert r["hit_rate"] > 0.1  # the shared system prompt is found


def test_the_decode_only_row_is_decodes_and_nothing_else():
    r = bench_scheduler.bench(32, 20, decode_only=True)
    assert r["running"] == 32
    assert r["tokens_per_step"] == 32  # one token per sequence per step
    assert r["preemptions"] == 0


def _is_git_checkout() -> bool:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          check=False)
    return done.returncode == 0


@pytest.mark.skipif(not _is_git_checkout(), reason="needs the git history")
def test_lockstep_runs_a_committed_revision_beside_the_working_tree():
    other = bench_scheduler.load_revision("HEAD")
    assert other.Scheduler.__module__.startswith("scheduler_svc_HEAD")
    assert other.Scheduler is not scheduler_steps.current_api().Scheduler
    r = bench_scheduler.lockstep(16, 10, 0.85, other)
    # Both ran the mixed workload (the working tree may differ from HEAD, so their
    # plans need not be equal).
    for side in ("theirs", "ours"):
        assert r[side]["running"] >= 12 and r[side]["tokens_per_step"] >= 12
    assert r["ratio"] > 0
    decode = bench_scheduler.lockstep(16, 10, 0.85, other, decode_only=True)
    for side in ("theirs", "ours"):  # every sequence decodes, every step
        assert decode[side]["running"] == 16 and decode[side]["tokens_per_step"] == 16
    assert decode["ratio"] > 0


def test_an_unknown_revision_is_one_clear_error():
    with pytest.raises(SystemExit, match="--against no-such-rev: git archive failed"):
        bench_scheduler.load_revision("no-such-rev")


def test_the_trace_mix_has_the_traces_lengths():
    from sim.data import default_trace

    if not default_trace().exists():
        pytest.skip("the Azure trace is not under ../shared/data")
    trace = bench_scheduler.load_trace_lengths()
    work = scheduler_steps.Workload(trace=trace)
    first = [work.request() for _ in range(3)]
    for req, (prompt_len, output_len) in zip(first, trace, strict=False):
        assert len(req.token_ids) == max(prompt_len, len(scheduler_steps.SYSTEM_PROMPT) + 1)
        assert req.max_tokens == output_len
    assert 1000 < work.mean_context < 1500  # prompts ~1,155 tokens, outputs ~211

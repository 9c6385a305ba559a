"""``continuum gate``: pass, fail and usage errors over bench results and telemetry windows.

The bench files are made by ``continuum bench``'s own summarizer
(``continuum.bench.report.summarize_outcomes``) from synthetic outcomes, so they have exactly
the shape ``continuum bench --output`` writes.
"""

from __future__ import annotations

import datetime as dt
import json
import random

import pytest

from continuum.bench.clients import Outcome
from continuum.bench.report import summarize_outcomes
from telemetry import TelemetryWriter
from tests.telemetry.test_report import run_cli
from tests.telemetry.test_store import seq


def outcomes(ttft_s: float, tpot_s: float, slow_tenant: str | None = None,
             n: int = 200, seed: int = 3) -> list[Outcome]:
    """Requests from tenants a, b, c over tiers 0 and 1 with the given median latencies."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tenant = "abc"[i % 3]
        ttft = ttft_s * rng.uniform(0.8, 1.2) * (5 if tenant == slow_tenant else 1)
        tokens = 20
        sent = i * 0.05
        first = sent + ttft
        finish = first + tpot_s * rng.uniform(0.9, 1.1) * (tokens - 1)
        out.append(Outcome(i, tenant, i % 2, 10, tokens, sent, first, finish, [],
                           output_tokens=tokens))
    return out


def bench_file(path, *points: list[Outcome], rates=None) -> str:
    reports = []
    for k, items in enumerate(points):
        report = summarize_outcomes(items, 10.0, {})
        report["config"] = {"request_rate": (rates or [4.0, 8.0])[k]}
        reports.append(report)
    path.write_text(json.dumps(reports, indent=2))
    return str(path)


@pytest.fixture
def baseline(tmp_path) -> str:
    return bench_file(tmp_path / "base.json", outcomes(0.100, 0.020))


def test_an_equal_candidate_passes(tmp_path, capsys, baseline):
    cand = bench_file(tmp_path / "cand.json", outcomes(0.100, 0.020, seed=4))
    code, out, _ = run_cli(capsys, "gate", baseline, cand)
    assert code == 0, out
    assert out.splitlines()[-1].startswith("gate: PASS")
    rows = out.splitlines()[1:-1]
    # overall + tiers premium and standard, TTFT and TPOT each; tenants a, b, c fairness.
    assert len(rows) == 3 * 2 + 3
    assert all(line.split()[-1] == "pass" for line in rows)


def test_a_ttft_regression_fails_with_exit_1(tmp_path, capsys, baseline):
    cand = bench_file(tmp_path / "cand.json", outcomes(0.130, 0.020))  # +30 % TTFT
    code, out, _ = run_cli(capsys, "gate", baseline, cand, "--format", "json")
    assert code == 1
    result = json.loads(out)
    assert result["pass"] is False
    failed = {(c["name"], c["group"]) for c in result["checks"] if c["result"] == "FAIL"}
    assert failed == {("TTFT p99 (ms)", g) for g in
                      ("overall", "tier premium", "tier standard")}
    # A looser limit lets the same candidate through.
    code, _, _ = run_cli(capsys, "gate", baseline, cand, "--ttft-p99-pct", "40")
    assert code == 0


def test_a_tpot_regression_fails(tmp_path, capsys, baseline):
    cand = bench_file(tmp_path / "cand.json", outcomes(0.100, 0.024))  # +20 % TPOT
    code, out, _ = run_cli(capsys, "gate", baseline, cand)
    assert code == 1
    assert {line.split()[0] for line in out.splitlines() if line.endswith("FAIL")} == {"TPOT"}


def test_one_starved_tenant_fails_fairness(tmp_path, capsys, baseline):
    cand = bench_file(tmp_path / "cand.json", outcomes(0.100, 0.020, slow_tenant="c"))
    code, out, _ = run_cli(capsys, "gate", baseline, cand, "--ttft-p99-pct", "1000",
                           "--format", "json")
    assert code == 1
    failed = [c for c in json.loads(out)["checks"] if c["result"] == "FAIL"]
    assert [c["group"] for c in failed] == ["tenant c"]
    code, _, _ = run_cli(capsys, "gate", baseline, cand, "--ttft-p99-pct", "1000",
                         "--fairness-factor", "0")
    assert code == 0


def test_a_tier_the_candidate_lost_fails(tmp_path, capsys, baseline):
    only_standard = [o for o in outcomes(0.100, 0.020) if o.tier == 1]
    cand = bench_file(tmp_path / "cand.json", only_standard)
    code, out, _ = run_cli(capsys, "gate", baseline, cand)
    assert code == 1
    assert "group missing in candidate" in out


@pytest.mark.parametrize("make, message", [
    (lambda p: str(p / "missing.json"), "cannot read baseline"),
    (lambda p: (p / "bad.json").write_text("{oops") and str(p / "bad.json"), "is not JSON"),
    (lambda p: (p / "x.json").write_text('{"a": 1}') and str(p / "x.json"),
     "is not a continuum bench result"),
])
def test_unreadable_inputs_exit_2_with_one_line(tmp_path, capsys, baseline, make, message):
    code, out, err = run_cli(capsys, "gate", make(tmp_path), baseline)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_mismatched_sweeps_and_bad_flags_exit_2(tmp_path, capsys, baseline):
    two = bench_file(tmp_path / "two.json", outcomes(0.1, 0.02), outcomes(0.1, 0.02))
    for argv, message in (([baseline, two], "run the same sweep"),
                          ([baseline], "give BASELINE and CANDIDATE"),
                          ([baseline, baseline, "--store", "x.db"], "not both"),
                          (["--store", "x.db"], "needs --baseline-window"),
                          ([baseline, baseline, "--tpot-p50-pct", "-1"], "must be >= 0")):
        code, _, err = run_cli(capsys, "gate", *argv)
        assert code == 2 and message in err, (argv, err)


def test_gate_over_two_telemetry_windows(store_target, capsys):
    """Last hour vs the hour before, from the store; fairness within each tier."""
    now = dt.datetime.now().timestamp()
    rng = random.Random(5)
    records = []
    for i in range(240):
        late = i % 2 == 1
        tenant = "xyz"[i % 3]
        ttft = rng.uniform(90, 110) * (1.5 if late else 1.0)  # +50 % in the candidate hour
        records.append(seq(i, tenant=tenant, tier=i % 3 and 1, queue_wait_ms=ttft / 2,
                           ttft_ms=ttft, tpot_p50_ms=20.0,
                           t=now - (1800 if late else 5400) - i))
    writer = TelemetryWriter.open(store_target)
    for r in records:
        writer.put(r)
    assert writer.flush(30)
    writer.close()
    args = ["gate", "--store", store_target, "--baseline-window", "2h..1h",
            "--candidate-window", "1h..now", "--format", "json"]
    code, out, _ = run_cli(capsys, *args)
    assert code == 1
    checks = json.loads(out)["checks"]
    failed = {(c["name"], c["group"]) for c in checks if c["result"] == "FAIL"}
    assert ("TTFT p99 (ms)", "overall") in failed
    assert all(name.startswith("TTFT") for name, _ in failed)
    # Premium has one tenant (x): no one to compare it with.
    assert {c["group"] for c in checks if c["name"].startswith("fairness")} == {
        "tier standard / tenant y", "tier standard / tenant z"}
    code, _, _ = run_cli(capsys, *args[:-2], "--ttft-p99-pct", "80")
    assert code == 0
    code, _, err = run_cli(capsys, "gate", "--store", store_target, "--baseline-window",
                           "5h..4h", "--candidate-window", "1h..")
    assert code == 2 and "no requests in it" in err

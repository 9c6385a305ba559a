"""``continuum report`` over a replayed workload equals the figures computed from the records.

The workload goes in through the real writer (as the scheduler will write it) and
comes out through the real command (``continuum.cli.main``), on both backends.
"""

from __future__ import annotations

import datetime as dt
import json
import random

import numpy as np
import pytest

from continuum.cli import main as cli_main
from continuum.ops.report import ReportError, parse_time, parse_window
from telemetry import TelemetryWriter
from tests.telemetry.test_store import seq, step

# The latest 14:00 local at least an hour ago (the whole workload is in the past);
# the "complaint" is about 14:05.
T0 = parse_time("14:00", dt.datetime.now().timestamp() - 3600)
TENANTS = {"acme": 0, "globex": 1, "initech": 2}


def replay(target: str, seed: int = 7) -> list:
    """A 10-minute workload: three tenants; initech queues for seconds from 14:04 to 14:06."""
    rng = random.Random(seed)
    records = []
    for i in range(300):
        tenant = rng.choice(sorted(TENANTS))
        done = T0 + rng.uniform(0, 600)
        wait = rng.expovariate(1 / 20.0)
        if tenant == "initech" and 240 <= done - T0 < 360:
            wait += 3000.0  # starved: the time is in the queue, not in prefill
        prefill = rng.uniform(30, 80)
        status = rng.choices(["finished", "rejected", "aborted"], [90, 6, 4])[0]
        records.append(seq(
            i, tenant=tenant, tier=TENANTS[tenant], t=done - i, status=status,
            queue_wait_ms=None if status == "rejected" else wait,
            ttft_ms=None if status == "rejected" else wait + prefill,
            tpot_p50_ms=None if status == "rejected" else rng.gammavariate(4, 5),
            preemptions_recompute=rng.choice([0, 0, 0, 1]), preemptions_swap=rng.choice([0, 1]),
            admitted_at=None if status == "rejected" else done - 1))
    steps = [step(T0 + i * 0.5, latency=10 + (i % 7), num_prefill_tokens=i % 300)
             for i in range(1200)]
    writer = TelemetryWriter.open(target)
    for r in records + steps:
        assert writer.put(r)
    assert writer.flush(60)
    writer.close()
    assert writer.num_written == len(records) + len(steps)
    return records


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        cli_main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def expected(records, **match) -> dict:
    rows = [r for r in records if all(getattr(r, k) == v for k, v in match.items())]
    done = [r for r in rows if r.status == "finished"]
    out = {"num_requests": len(rows), "num_completed": len(done),
           "num_rejected": sum(r.status == "rejected" for r in rows),
           "preemptions_swap": sum(r.preemptions_swap for r in rows)}
    for key, values in (("queue_wait", [r.queue_wait_ms for r in done]),
                        ("ttft", [r.ttft_ms for r in done]),
                        ("tpot", [r.tpot_p50_ms for r in done]),
                        ("prefill", [r.ttft_ms - r.queue_wait_ms for r in done])):
        out[f"{key}_median_ms"] = float(np.percentile(values, 50))
        out[f"{key}_p99_ms"] = float(np.percentile(values, 99))
    return out


def assert_figures(got: dict, want: dict) -> None:
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


def test_report_figures_equal_those_computed_from_the_records(store_target, capsys):
    records = replay(store_target)
    since, until = _iso(T0), _iso(T0 + 601)
    code, out, _ = run_cli(capsys, "report", "--store", store_target, "--since", since,
                           "--until", until, "--format", "json")
    assert code == 0
    report = json.loads(out)
    assert_figures(report["overall"], expected(records))
    for tenant, tier in TENANTS.items():
        assert_figures(report["by_tenant"][tenant], expected(records, tenant=tenant))
        tier_name = ("premium", "standard", "best_effort")[tier]
        assert_figures(report["by_tier"][tier_name], expected(records, tier=tier))
    assert report["steps"]["num_steps"] == 1200
    assert report["steps"]["step_latency_max_ms"] == 16.0


def test_why_was_initech_slow_at_1405_in_one_call(store_target, capsys):
    """A window around the complaint shows initech's TTFT is queue wait, not prefill."""
    records = replay(store_target)
    code, out, _ = run_cli(capsys, "report", "--store", store_target,
                           "--since", _iso(T0 + 240), "--until", _iso(T0 + 360))
    assert code == 0
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("tenant ")}
    assert lines["initech"].rstrip().endswith("queue")
    assert lines["acme"].rstrip().endswith("prefill")
    window = [r for r in records if T0 + 240 <= r.completed_at < T0 + 360]
    want = expected(window, tenant="initech")
    assert f"{want['queue_wait_p99_ms']:.0f}" in lines["initech"]
    # The same window, one tenant, as JSON: the one tenant only.
    code, out, _ = run_cli(capsys, "report", "--store", store_target, "--since",
                           _iso(T0 + 240), "--until", _iso(T0 + 360), "--tenant", "initech",
                           "--format", "json")
    assert list(json.loads(out)["by_tenant"]) == ["initech"]
    assert_figures(json.loads(out)["overall"], want)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t).isoformat()


def test_plot_is_written(tmp_path, capsys):
    target = str(tmp_path / "t.db")
    replay(target)
    png = tmp_path / "r.png"
    code, out, _ = run_cli(capsys, "report", "--store", target, "--since",
                           _iso(T0), "--plot", str(png))
    assert code == 0 and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--since", "yesterday"], "--since 'yesterday': use a duration"),
    (["--since", "10m", "--until", "1h"], "is not after --since"),
    (["--since", "25:00"], "not a clock time"),
    (["--tier", "gold"], "--tier 'gold': one of premium, standard, best_effort"),
])
def test_report_usage_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    target = str(tmp_path / "t.db")
    TelemetryWriter.open(target).close()
    code, out, err = run_cli(capsys, "report", "--store", target, *argv)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_report_on_a_missing_store_says_so(tmp_path, capsys):
    code, _, err = run_cli(capsys, "report", "--store", str(tmp_path / "nope.db"))
    assert code == 2 and "no telemetry store at" in err


def test_time_forms():
    now = dt.datetime(2026, 12, 1, 15, 0, 0).timestamp()
    assert parse_time("90s", now) == now - 90
    assert parse_time("1.5h", now) == now - 5400
    assert parse_time("14:05", now) == dt.datetime(2026, 12, 1, 14, 5).timestamp()
    assert parse_time("16:00", now) == dt.datetime(2026, 11, 30, 16, 0).timestamp()
    assert parse_time("2026-12-01T14:05:00Z", now) == dt.datetime(
        2026, 12, 1, 14, 5, tzinfo=dt.UTC).timestamp()
    assert parse_window("2h..1h", now, "--w") == (now - 7200, now - 3600)
    assert parse_window("30m..", now, "--w") == (now - 1800, now)
    with pytest.raises(ReportError, match="SINCE..UNTIL"):
        parse_window("2h", now, "--w")
    with pytest.raises(ReportError, match="ends before it starts"):
        parse_window("1h..2h", now, "--w")

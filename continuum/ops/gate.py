"""``continuum gate``: refuse a deploy whose latency regressed against the previous build.

The deploy gate, per tier: the candidate fails if its p99 TTFT is more
than ``--ttft-p99-pct`` (20 %) or its p50 TPOT more than ``--tpot-p50-pct``
(15 %) above the baseline's — overall and for every tier the baseline served
(a tier the candidate no longer serves fails). Plus a fairness check on the
candidate alone: no tenant's p99 TTFT may exceed ``--fairness-factor`` (2×)
times the median of the other tenants' p99 in the same group (0 turns it off).

Inputs are two ``continuum bench --output`` files (``gate BASELINE CANDIDATE``;
a sweep's points are compared rate by rate, so both must be the same sweep), or
two windows of one telemetry store (``--baseline-window 2h..1h --candidate-window
1h..now``; the store and the windows as ``continuum report`` finds and reads them,
``--store S`` for another). For
bench files fairness compares all tenants (bench draws tiers independently of
tenants); for telemetry windows it compares tenants within each tier, since a
best-effort tenant is meant to be slower than a premium one.

Prints a table of every check (or ``--format json``); exit status 0 when all
pass, 1 when any fails (so CI or a canary controller can use it as is), 2 with
one line on stderr for a usage error (missing or unreadable input, bad flag).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from continuum.ops.report import ReportError, build_report, emit, json_safe, parse_window
from continuum.serve import local_state
from telemetry import StoreError, TelemetryStore


class GateError(Exception):
    """A usage error (exit 2): the message says which input or flag and why."""


@dataclass(frozen=True)
class Check:
    name: str  # e.g. "TTFT p99 (ms)"
    group: str  # e.g. "rate 4 / tier premium"
    baseline: float | None
    candidate: float | None
    change: str  # "+8.3%" or "2.50x"
    limit: str
    result: str  # "pass", "FAIL" or "skip"
    note: str = ""


def _load_bench(path: str, role: str) -> list[dict]:
    """A bench result file as its list of points (``continuum bench`` writes a list)."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except OSError as exc:
        raise GateError(f"cannot read {role} {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise GateError(f"{role} {path} is not JSON: {exc}") from exc
    points = data if isinstance(data, list) else [data]
    if not points or not all(isinstance(p, dict) and isinstance(p.get("overall"), dict)
                             for p in points):
        raise GateError(f"{role} {path} is not a continuum bench result "
                        "(write one with continuum bench --output)")
    return points


def _label(point: dict, many: bool, index: int) -> str:
    rate = point.get("config", {}).get("request_rate")
    return (f"rate {rate:g} / " if rate is not None else f"point {index} / ") if many else ""


def _regression(name: str, key: str, pct: float, group: str, base: dict | None,
                cand: dict | None) -> Check:
    b = None if base is None else base.get(key)
    c = None if cand is None else cand.get(key)
    limit = f"+{pct:g}%"
    if b is None or (isinstance(b, float) and math.isnan(b)) or b <= 0:
        return Check(name, group, b, c, "-", limit, "skip", "no baseline figure")
    if c is None or (isinstance(c, float) and math.isnan(c)):
        why = "group missing in candidate" if cand is None else "no candidate figure"
        return Check(name, group, b, None, "-", limit, "FAIL", why)
    delta = (c - b) / b * 100
    return Check(name, group, b, c, f"{delta:+.1f}%", limit,
                 "pass" if delta <= pct else "FAIL")


def _fairness(group: str, tenants: dict, factor: float) -> list[Check]:
    figures = {n: s.get("ttft_p99_ms") for n, s in tenants.items()}
    figures = {n: v for n, v in figures.items() if v is not None and not math.isnan(v)}
    out = []
    for name, value in sorted(figures.items()):
        others = [v for n, v in figures.items() if n != name]
        if not others:
            continue
        ref = statistics.median(others)
        ratio = value / ref if ref > 0 else math.inf
        out.append(Check("fairness TTFT p99 (ms)", f"{group}tenant {name}", ref, value,
                         f"{ratio:.2f}x", f"{factor:g}x", "pass" if ratio <= factor else "FAIL",
                         "baseline column: median of the other tenants' p99"))
    return out


def compare(baseline: list[dict], candidate: list[dict], ttft_pct: float = 20.0,
            tpot_pct: float = 15.0, fairness_factor: float = 2.0,
            fairness_within_tier: bool = False) -> list[Check]:
    """Every check of ``candidate`` against ``baseline`` (lists of report points)."""
    if len(baseline) != len(candidate):
        raise GateError(f"baseline has {len(baseline)} load points, candidate "
                        f"{len(candidate)}: run the same sweep for both")
    checks = []
    for i, (base, cand) in enumerate(zip(baseline, candidate, strict=True)):
        rates = [p.get("config", {}).get("request_rate") for p in (base, cand)]
        if rates[0] != rates[1]:
            raise GateError(f"load point {i}: baseline rate {rates[0]} vs candidate "
                            f"{rates[1]}: run the same sweep for both")
        prefix = _label(base, len(baseline) > 1, i)
        groups = [("overall", base["overall"], cand["overall"])]
        groups += [(f"tier {t}", s, cand.get("by_tier", {}).get(t))
                   for t, s in base.get("by_tier", {}).items()]
        for group, b, c in groups:
            checks.append(_regression("TTFT p99 (ms)", "ttft_p99_ms", ttft_pct,
                                      prefix + group, b, c))
            checks.append(_regression("TPOT p50 (ms)", "tpot_median_ms", tpot_pct,
                                      prefix + group, b, c))
        if fairness_factor > 0:
            if fairness_within_tier:
                for tier, s in cand.get("by_tier", {}).items():
                    checks += _fairness(f"{prefix}tier {tier} / ", s.get("by_tenant", {}),
                                        fairness_factor)
            else:
                checks += _fairness(prefix, cand.get("by_tenant", {}), fairness_factor)
    return checks


def _fmt(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.1f}"


def format_table(checks: list[Check]) -> str:
    lines = [f"{'check':<24}{'group':<36}{'baseline':>10}{'candidate':>11}{'change':>9}"
             f"{'limit':>7}  result"]
    for c in checks:
        lines.append(f"{c.name:<24}{c.group[:35]:<36}{_fmt(c.baseline):>10}"
                     f"{_fmt(c.candidate):>11}{c.change:>9}{c.limit:>7}  {c.result}"
                     + (f"  ({c.note})" if c.note and c.result != "pass" else ""))
    failed = sum(c.result == "FAIL" for c in checks)
    lines.append(f"gate: {'FAIL' if failed else 'PASS'} ({failed} of {len(checks)} checks "
                 "failed)")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("baseline", nargs="?", help="previous build's continuum bench --output JSON")
    p.add_argument("candidate", nargs="?", help="this build's continuum bench --output JSON")
    p.add_argument("--store", default=None,
                   help="compare two windows of this telemetry store (SQLite path or "
                        f"postgresql:// DSN; with the windows alone: "
                        f"${local_state.ENV_TELEMETRY_DSN}, else serve's default store)")
    p.add_argument("--baseline-window", default=None, help="a store's window: SINCE..UNTIL")
    p.add_argument("--candidate-window", default=None, help="a store's window: SINCE..UNTIL")
    p.add_argument("--ttft-p99-pct", type=float, default=20.0,
                   help="fail if p99 TTFT rises more than this %% (default 20)")
    p.add_argument("--tpot-p50-pct", type=float, default=15.0,
                   help="fail if p50 TPOT rises more than this %% (default 15)")
    p.add_argument("--fairness-factor", type=float, default=2.0,
                   help="fail if a tenant's p99 TTFT exceeds this × the median of the "
                        "others' (default 2; 0: no fairness check)")
    p.add_argument("--format", choices=("table", "json"), default="table")


def _inputs(args: argparse.Namespace) -> tuple[list[dict], list[dict], bool]:
    files = args.baseline is not None or args.candidate is not None
    windowed = args.store is not None or args.baseline_window or args.candidate_window
    if not windowed:
        if args.baseline is None or args.candidate is None:
            raise GateError("give BASELINE and CANDIDATE bench files, or --baseline-window "
                            "and --candidate-window of a telemetry store")
        return _load_bench(args.baseline, "baseline"), _load_bench(args.candidate,
                                                                   "candidate"), False
    if files:
        raise GateError("give either two bench files or a store's windows, not both")
    if not (args.baseline_window and args.candidate_window):
        raise GateError("a store needs --baseline-window and --candidate-window")
    now = time.time()
    windows = [parse_window(args.baseline_window, now, "--baseline-window"),
               parse_window(args.candidate_window, now, "--candidate-window")]
    dsn, source = local_state.telemetry_store(args.store, "--store")
    print(f"continuum gate: store {local_state.describe(dsn)} ({source})", file=sys.stderr)
    with TelemetryStore.open(dsn, migrate=False) as store:
        base, cand = (build_report(store, a, b) for a, b in windows)
    if not base["overall"]["num_requests"]:
        raise GateError(f"--baseline-window {args.baseline_window}: no requests in it")
    return [base], [cand], True


def main(args: argparse.Namespace) -> int:
    try:
        for flag in ("ttft_p99_pct", "tpot_p50_pct", "fairness_factor"):
            if getattr(args, flag) < 0:
                raise GateError(f"--{flag.replace('_', '-')} must be >= 0")
        baseline, candidate, within_tier = _inputs(args)
        checks = compare(baseline, candidate, args.ttft_p99_pct, args.tpot_p50_pct,
                         args.fairness_factor, within_tier)
    except (GateError, ReportError, StoreError) as exc:
        print(f"continuum gate: {exc}", file=sys.stderr)
        return 2
    failed = any(c.result == "FAIL" for c in checks)
    if args.format == "json":
        emit(json.dumps({"pass": not failed,
                         "checks": [json_safe(asdict(c)) for c in checks]}, indent=2))
    else:
        emit(format_table(checks))
    return 1 if failed else 0

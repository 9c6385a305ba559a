"""``continuum report``: per-tier and per-tenant latency over a window of the telemetry store.

It answers "why was tenant X slow at 14:05" in one call: ``continuum report
--since 14:00 --until 14:10 --tenant X`` prints (from the store ``continuum serve``
writes, found as serve finds it, continuum/serve/local_state.py; ``--store`` names
another, and stderr says which was read), per tier and per
tenant, p50/p99 of the three parts a request's latency splits into — queue wait
(arrival to admission), prefill (admission to first token, TTFT minus queue
wait) and TPOT (per-request median gap between output tokens) — beside TTFT,
preemptions by kind, rejections and the median prompt length, and what the
scheduler's steps looked like over the same window (step latency, prefill tokens
per step, free blocks). A
tenant whose TTFT p99 is mostly queue wait was starved or shed; mostly prefill,
its prompts were long or chunked behind others; a high TPOT with slow steps,
the batch was crowded or prefill-heavy.

Definitions: a request belongs to the window its ``completed_at`` falls in;
latency percentiles are over finished requests (``sim.metrics.percentile``,
linear, numpy's default); rejections count requests with status ``rejected``.
``--since``/``--until`` take durations back from now (``90s``, ``15m``, ``1h``,
``2d``), clock times (``14:05``, the latest one not in the future), ISO times
(``2026-12-01T14:05``, ``...Z``) or ``now``; times without a zone are local.
Exit status: 0, or 2 with one line on stderr for a bad flag or unreadable store.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Sequence

from continuum.serve import local_state
from protos import tiers
from sim.metrics import percentile
from telemetry import SequenceRecord, StoreError, TelemetryStore

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")
# (statistic key prefix, SequenceRecord -> value in ms or None)
_LATENCIES = (
    ("queue_wait", lambda r: r.queue_wait_ms),
    ("prefill", lambda r: None if r.ttft_ms is None or r.queue_wait_ms is None
     else r.ttft_ms - r.queue_wait_ms),
    ("ttft", lambda r: r.ttft_ms),
    ("tpot", lambda r: r.tpot_p50_ms),
)


class ReportError(Exception):
    """A usage error: a bad time, tier or store; the message names the flag."""


def parse_time(text: str, now: float, flag: str = "time") -> float:
    """Unix seconds for ``text`` (see the module docstring for the forms)."""
    text = text.strip()
    if text == "now":
        return now
    if m := _DURATION.match(text):
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    if m := _CLOCK.match(text):
        hour, minute, second = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
        if hour > 23 or minute > 59 or second > 59:
            raise ReportError(f"{flag} {text!r}: not a clock time")
        local = dt.datetime.fromtimestamp(now).replace(hour=hour, minute=minute,
                                                        second=second, microsecond=0)
        if local.timestamp() > now:
            local -= dt.timedelta(days=1)
        return local.timestamp()
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ReportError(f"{flag} {text!r}: use a duration (15m, 1h, 2d), a clock time "
                          "(14:05), an ISO time (2026-12-01T14:05) or 'now'") from None


def parse_window(text: str, now: float, flag: str) -> tuple[float, float]:
    """``SINCE..UNTIL`` (either form of ``parse_time``; UNTIL defaults to now)."""
    since, sep, until = text.partition("..")
    if not sep:
        raise ReportError(f"{flag} {text!r}: write SINCE..UNTIL, e.g. 2h..1h or 14:00..14:30")
    start = parse_time(since, now, flag)
    end = parse_time(until, now, flag) if until.strip() else now
    if end <= start:
        raise ReportError(f"{flag} {text!r}: the window ends before it starts")
    return start, end


def parse_tier(text: str | None) -> int | None:
    if text is None:
        return None
    tier = tiers.parse(text)
    if tier is None:
        raise ReportError(f"--tier {text!r}: one of {', '.join(tiers.NAMES)}")
    return tier


def summarize(records: Sequence[SequenceRecord]) -> dict:
    """Counts and p50/p99 latencies (ms) of ``records``; keys as ``continuum bench``'s
    (``ttft_median_ms``, ``ttft_p99_ms``, ...), NaN where nothing was measured."""
    finished = [r for r in records if r.status == "finished"]
    out: dict = {
        "num_requests": len(records),
        "num_completed": len(finished),
        "num_rejected": sum(r.status == "rejected" for r in records),
        "num_aborted": sum(r.status == "aborted" for r in records),
        "num_failed": sum(r.status == "failed" for r in records),
        "preemptions_recompute": sum(r.preemptions_recompute for r in records),
        "preemptions_swap": sum(r.preemptions_swap for r in records),
        "output_tokens": sum(r.output_tokens for r in records),
        # Long prompts explain a long prefill (and make a likelier preemption victim).
        "prompt_tokens_median": percentile([r.prompt_tokens for r in records], 50),
    }
    for name, get in _LATENCIES:
        values = [v for v in map(get, finished) if v is not None]
        out[f"{name}_median_ms"] = percentile(values, 50)
        out[f"{name}_p99_ms"] = percentile(values, 99)
    return out


def _steps(store: TelemetryStore, since: float, until: float) -> dict:
    minutes = store.iteration_minutes(since, until)
    n = sum(m.num_steps for m in minutes)
    if not n:
        return {"num_steps": 0}
    return {
        "num_steps": n,
        "step_latency_mean_ms": sum(m.sum_step_latency_ms for m in minutes) / n,
        "step_latency_max_ms": max(m.max_step_latency_ms for m in minutes),
        "prefill_tokens_per_step": sum(m.sum_prefill_tokens for m in minutes) / n,
        "decode_tokens_per_step": sum(m.sum_decode_tokens for m in minutes) / n,
        "seqs_per_step": sum(m.sum_num_seqs for m in minutes) / n,
        "min_free_blocks": min(m.min_free_blocks for m in minutes),
        "preemptions": sum(m.sum_preemptions for m in minutes),
    }


def build_report(store: TelemetryStore, since: float, until: float,
                 tenant: str | None = None, tier: int | None = None) -> dict:
    """The report as data (what ``--format json`` prints)."""
    records = store.sequences(since, until, tenant=tenant, tier=tier)
    by_tier: dict = {}
    for t in sorted({r.tier for r in records}):
        rows = [r for r in records if r.tier == t]
        by_tier[tiers.name(t)] = {
            **summarize(rows),
            "by_tenant": {n: summarize([r for r in rows if r.tenant == n])
                          for n in sorted({r.tenant for r in rows})}}
    return {
        "window": {"since": since, "until": until,
                   "since_local": dt.datetime.fromtimestamp(since).isoformat(" ", "seconds"),
                   "until_local": dt.datetime.fromtimestamp(until).isoformat(" ", "seconds")},
        "filter": {"tenant": tenant, "tier": None if tier is None else tiers.name(tier)},
        "overall": summarize(records),
        "by_tier": by_tier,
        "by_tenant": {n: summarize([r for r in records if r.tenant == n])
                      for n in sorted({r.tenant for r in records})},
        "steps": _steps(store, since, until),
    }


def _ms(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.0f}"


def _mostly(s: dict) -> str:
    """Which part dominates the TTFT tail: where to look first."""
    q, p = s["queue_wait_p99_ms"], s["prefill_p99_ms"]
    if math.isnan(q) or math.isnan(p):
        return "-"
    return "queue" if q >= p else "prefill"


def format_table(report: dict) -> str:
    w = report["window"]
    lines = [f"telemetry {w['since_local']} .. {w['until_local']}"
             + "".join(f", {k} {v}" for k, v in report["filter"].items() if v),
             f"{'group':<24}{'reqs':>6}{'done':>6}{'rej':>5}{'abrt':>5}{'prompt':>7}"
             f"{'pre rc/sw':>10}"
             f"{'queue p50':>10}{'p99':>7}{'prefill p50':>12}{'p99':>7}{'TTFT p50':>9}"
             f"{'p99':>7}{'TPOT p50':>9}{'p99':>7}{'TTFT p99 is':>12}   (ms; prompt: tokens)"]

    def row(name: str, s: dict) -> str:
        pre = f"{s['preemptions_recompute']}/{s['preemptions_swap']}"
        return (f"{name:<24}{s['num_requests']:>6}{s['num_completed']:>6}"
                f"{s['num_rejected']:>5}{s['num_aborted']:>5}"
                f"{_ms(s['prompt_tokens_median']):>7}{pre:>10}"
                f"{_ms(s['queue_wait_median_ms']):>10}{_ms(s['queue_wait_p99_ms']):>7}"
                f"{_ms(s['prefill_median_ms']):>12}{_ms(s['prefill_p99_ms']):>7}"
                f"{_ms(s['ttft_median_ms']):>9}{_ms(s['ttft_p99_ms']):>7}"
                f"{_ms(s['tpot_median_ms']):>9}{_ms(s['tpot_p99_ms']):>7}{_mostly(s):>12}")

    lines.append(row("overall", report["overall"]))
    for tier, s in report["by_tier"].items():
        lines.append(row(f"tier {tier}", s))
        lines.extend(row(f"  {tenant[:20]}", t) for tenant, t in s["by_tenant"].items())
    for tenant, s in report["by_tenant"].items():
        lines.append(row(f"tenant {tenant[:17]}", s))
    st = report["steps"]
    if st["num_steps"]:
        lines.append(f"steps: {st['num_steps']}, latency mean {st['step_latency_mean_ms']:.1f} "
                     f"max {st['step_latency_max_ms']:.1f} ms, per step "
                     f"{st['seqs_per_step']:.1f} seqs / {st['decode_tokens_per_step']:.1f} "
                     f"decode / {st['prefill_tokens_per_step']:.1f} prefill tokens, "
                     f"min free blocks {st['min_free_blocks']}, "
                     f"preemptions {st['preemptions']}")
    else:
        lines.append("steps: none recorded in this window")
    return "\n".join(lines)


def json_safe(value):
    """``value`` with NaN as null: strict JSON (jq, browsers) has no NaN."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None,
                   help="telemetry store: SQLite file path or postgresql:// DSN (default: "
                        f"${local_state.ENV_TELEMETRY_DSN}, else the store `continuum serve` "
                        "writes by default)")
    p.add_argument("--since", default="1h", help="window start (15m, 1h, 14:05, ISO; "
                                                 "default 1h)")
    p.add_argument("--until", default="now", help="window end (same forms; default now)")
    p.add_argument("--tenant", default=None, help="only this tenant")
    p.add_argument("--tier", default=None, help="only this tier: " + "|".join(tiers.NAMES))
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--plot", type=pathlib.Path, default=None,
                   help="PNG of queue wait, TTFT, TPOT and steps over the window")


def main(args: argparse.Namespace) -> int:
    now = time.time()
    try:
        since = parse_time(args.since, now, "--since")
        until = parse_time(args.until, now, "--until")
        if until <= since:
            raise ReportError(f"--until {args.until!r} is not after --since {args.since!r}")
        tier = parse_tier(args.tier)
        dsn, source = local_state.telemetry_store(args.store, "--store")
        print(f"continuum report: store {local_state.describe(dsn)} ({source})",
              file=sys.stderr)
        with TelemetryStore.open(dsn, migrate=False) as store:
            report = build_report(store, since, until, args.tenant, tier)
            if args.plot:
                from continuum.ops.report_plot import plot

                plot(store, since, until, args.tenant, tier, args.plot)
    except (ReportError, StoreError) as exc:
        print(f"continuum report: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(json_safe(report), indent=2) if args.format == "json" else None
    emit(text or format_table(report))
    if args.plot:
        print(f"plot: {args.plot}", file=sys.stderr if args.format == "json" else sys.stdout)
    return 0


def emit(text: str) -> None:
    """Print ``text``; a reader that went away (``| head``) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's exit flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

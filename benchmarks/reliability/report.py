"""The summary table: one line per row (chaos: one per fault), its figures, its target,
and whether the target was met. Markdown for people, JSON (every figure) for tools."""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import subprocess

from benchmarks.reliability import bad_specs, burst, fuzz_schema
from harness import openapi_run


def _machine() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


_OWN_SUMMARY = {"bad_specs": bad_specs.summary, "burst": burst.summary,
                "openapi": openapi_run.summary}


def summarize(row: dict) -> tuple[str, str, str, bool]:
    """(row name, measured, target, met) for one row's figures."""
    kind = row["row"]
    if "error" in row:
        return (kind, f"could not run: {row['error']}", "runs", False)
    if kind in _OWN_SUMMARY:  # rows whose module says what they measured
        return _OWN_SUMMARY[kind](row)
    if kind == "overload_10x":
        refused = row["refused_frac"]
        return ("overload at 10x capacity",
                f"capacity {row['capacity_rps']} req/s, offered {row['offered']} at "
                f"{row['offered_rps']} req/s: refused {refused:.0%} "
                f"({row['refused_with_retry_hint']} with retry hint, p99 "
                f"{row['refuse_p99_s']} s), completed {row['completed']} (TTFT p99 "
                f"{row['accepted_ttft_p99_s']} s), no answer in {row['deadline_s']:.0f} s: "
                f"{row['no_answer']}, server errors {row['server_errors']}; RSS MiB "
                f"{row['rss_mib_before']} -> peak {row['rss_mib_peak']} -> "
                f"{row['rss_mib_after']}",
                "excess refused at once with a retry hint; 0 unanswered; 0 server errors",
                refused > 0 and row["refused_with_retry_hint"] == row["refused"]
                and row["no_answer"] == 0 and row["server_errors"] == 0)
    if kind == "soak":
        ok = (row["lost"] == 0 and row["server_errors"] == 0 and row["idle_clean_1"]
              and row["idle_clean_2"] and row["fds_ok"] and row["rss_ok"])
        return ("soak: cancels, disconnects, deadlines",
                f"{row['streams']} streams / {row['seconds']:.0f} s ({row['by_action']}); "
                f"refused {row.get('refused', 0)}, lost {row['lost']}, server errors "
                f"{row['server_errors']}; idle: blocks free "
                f"{row['blocks_free']}, running/waiting {row['running_waiting']}, executor "
                f"sequences {row['executor_sequences']}; fd growth {row['fd_growth']}, "
                f"RSS growth MiB {row['rss_growth_mib']}",
                "0 lost, 0 errors; idle clean; no fd/RSS growth", ok)
    if kind == "fuzz":
        statuses = "; ".join(f"{t}: {dict(sorted(c.items()))}"
                             for t, c in row["statuses"].items())
        return ("fuzz (hypothesis): HTTP, gRPC, ZeroMQ both ends",
                f"{row['examples']} inputs in {row['seconds']} s; failures "
                f"{row['failures']}; processes survived: {row['processes_survived']}; "
                f"{statuses}",
                "no 5xx/INTERNAL/UNKNOWN/hang, no process death, serves afterwards",
                row["failures"] == 0 and row["processes_survived"])
    if kind == "schema_fuzz":
        return _schema_fuzz(row)
    if kind == "chaos":
        return _chaos(row)
    if kind == "hostile_itl":
        ratio, target = row["ratio_p99"], row.get("target_ratio")
        within = ratio is not None and (target is None or ratio <= target)
        return (f"{row.get('mix', 'costly')} hostile traffic: normal stream ITL p99 vs "
                f"{row.get('against', 'quiet')}",
                f"{row.get('against', 'without')}: {row['itl_p99_ms_without']} ms, with "
                f"{row['hostile_rps']:.0f} "
                f"hostile req/s {row['itl_p99_ms_with']} ms: {ratio}x (p50 "
                f"{row['itl_p50_ms_without']} -> {row['itl_p50_ms_with']} ms); normal "
                f"streams not ok {row.get('normal_not_ok', 0)}; server errors "
                f"{row['server_errors']}",
                f"<= {target}x" if target else "reported; 0 server errors",
                within and row["server_errors"] == 0)
    return (kind, json.dumps(row)[:200], "", False)


def _schema_fuzz(row: dict) -> tuple[str, str, str, bool]:
    statuses = "; ".join(f"{t} ({row['fields'][t]} fields): {dict(sorted(c.items()))}"
                         for t, c in row["statuses"].items())
    kept = all(row["processes_kept"].values())
    return ("schema fuzz: every field of HTTP and gRPC, under normal streams",
            f"{row['examples']} requests in {row['seconds']} s; server errors "
            f"{row['server_errors']}, slow (> {row['timeout_s']:.0f} s) {row['slow']}, "
            f"echoes {row['echoes']}, failures {row['failures']}; {row['stream_rounds']} rounds of "
            f"{row['num_streams']} greedy streams identical: {row['streams_identical']} "
            f"(slowest round {row['stream_round_s_max']} s); /health "
            f"{row['health_status']}, normal request ok {row['normal_request_ok']}, "
            f"pids kept {kept}; {statuses}",
            "0 server errors, 0 slow, 0 echoes; streams identical; healthy, same pids",
            fuzz_schema.met(row))


def _chaos(row: dict) -> tuple[str, str, str, bool]:
    cols = ", ".join(f"{c} {row[c]}" for c in ("identical", "duplicated", "diverged",
                                               "lost", "errored", "ended"))
    ok = (row["duplicated"] == row["diverged"] == row["lost"] == row["errored"] == 0
          and row.get("blocks_free_after", True))
    return (f"chaos: {row['fault']} during {row['phase']}",
            f"{row['streams']} streams: {cols}; recovery {row['recovery_s']} s; "
            f"blocks free after: {row.get('blocks_free_after', 'n/a')}",
            "0 lost, 0 duplicated, 0 errored", ok)


def markdown(rows: list[dict], size: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Reliability ({size} form), {now}, {_machine()}, git {_revision()}", "",
             "| row | measured | target | met |", "|---|---|---|---|"]
    for row in rows:
        name, measured, target, met = summarize(row)
        lines.append(f"| {name} | {measured} | {target} | {'yes' if met else '**no**'} |")
    return "\n".join(lines)


def write_json(rows: list[dict], size: str, path: pathlib.Path) -> None:
    doc = {"size": size, "machine": _machine(), "git": _revision(),
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "rows": rows, "met": {summarize(r)[0]: summarize(r)[3] for r in rows}}
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")

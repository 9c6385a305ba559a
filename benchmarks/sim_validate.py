"""The simulator against the real server (docs/simulator.md).

One ``continuum bench`` workload (Azure lengths x ``--length-scale``, Poisson arrivals, a
long-prompt burst half way) at three fractions of the profile's predicted saturation rate
(``--rates`` overrides), each run through a real ``continuum serve`` and through the
simulator with the same requests, scheduler config and KV pool; per rate, measured against
simulated throughput, TTFT, TPOT and preemptions, with the error. ``python -m sim --profile
FILE --validate-against-server`` runs this as a process (sim/ imports only the core).

    .venv/bin/python -m benchmarks.sim_validate --profile FILE [--rates 1,2,3] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import sim_server
from benchmarks.sim_calibration import (
    CALIBRATION_BATCH,
    CALIBRATION_PROMPTS,
    calibration,
    run_speed,
    simulated,
)
from benchmarks.sim_server import measured
from harness.servers import Serve
from scheduler_svc.core import SchedulerConfig
from sim.profile import ExecutorProfile

FIGURES = ("output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
           "preemptions")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What each rate replays (full: minutes on a quiet 2-core machine; quick: CI)."""

    num_prompts: int = 120
    length_scale: float = 0.1  # Azure mean 1,155 / 211 tokens -> ~115 / ~21
    max_input_len: int = 512
    max_output_len: int = 64
    burst: int = 6
    long_len: int = 384
    fractions: tuple[float, ...] = (0.4, 0.7, 1.0)  # of the predicted saturation rate
    max_num_seqs: int = 32
    kv_cache_bytes: int = 96 << 20  # small enough that the burst can preempt


QUICK = Workload(num_prompts=8, length_scale=0.03, max_input_len=64, max_output_len=8,
                 burst=2, long_len=96)


def bench_specs(w: Workload, rate: float, seed: int):
    """``continuum bench --dataset azure`` requests at ``rate``, plus the burst."""
    from continuum.bench.run import add_arguments, validate_args
    from continuum.bench.workload import TOKEN_ID_RANGE, Spec, build_workload

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([
        "--dataset", "azure", "--length-scale", str(w.length_scale),
        "--max-input-len", str(w.max_input_len), "--max-output-len", str(w.max_output_len),
        "--num-prompts", str(w.num_prompts), "--request-rate", str(rate),
        "--seed", str(seed), "--no-progress"])
    validate_args(args)
    specs = build_workload(args, rate)
    at = specs[len(specs) // 2].arrival_s
    rng = random.Random(seed + 1)
    for _ in range(w.burst):
        ids = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(w.long_len)]
        specs.append(Spec(index=len(specs), arrival_s=at, prompt_ids=ids,
                          max_tokens=w.max_output_len))
    specs.sort(key=lambda s: s.arrival_s)
    for i, s in enumerate(specs):
        s.index = i
    return specs


def saturation_rps(profile: ExecutorProfile, w: Workload) -> float:
    """Requests/s the profile serves at ``max_num_seqs`` // 2 concurrent decodes: each
    request's prefill alone plus its share of the batch's decode steps (Azure means)."""
    prompt = min(w.max_input_len, 1155 * w.length_scale)
    output = max(1.0, min(w.max_output_len, 211 * w.length_scale))
    batch = max(1, w.max_num_seqs // 2)
    decode = profile.decode_step_time(batch, int(prompt + output / 2)) / batch
    return 1.0 / (profile.prefill_time(int(prompt)) + output * decode)


def error_pct(real: float, sim: float) -> float:
    if real == sim:
        return 0.0
    if not real or math.isnan(real) or math.isnan(sim):
        return float("nan")
    return 100.0 * (sim / real - 1.0)


RUN_SPEED = "at the run's speed"


def _calibration_line(profile: ExecutorProfile, calibrate_speed: bool) -> str:
    speed = (f"its machine runs the profile's steps x {profile.speed_scale:.3f} (lone "
             f"prefills of {CALIBRATION_PROMPTS[0]} and {CALIBRATION_PROMPTS[1]} tokens)"
             if calibrate_speed else "the profile's speed kept (--no-speed-calibration)")
    return (f"calibrated on the server: {speed}; its overhead over the profile "
            f"{profile.link_overhead_s * 1e3:.2f} ms a step + "
            f"{profile.link_overhead_per_seq_s * 1e3:.2f} ms a sequence (TPOT of 1 "
            f"and of {CALIBRATION_BATCH} requests minus the scaled decode steps) + "
            f"{profile.link_overhead_per_prompt_s * 1e3:.2f} ms a new prompt (where "
            f"the simulated TTFT of {CALIBRATION_BATCH} together meets the measured)")


def _at_run_speed(server: Serve, real: dict, profile: ExecutorProfile,
                  config: SchedulerConfig, specs, stats, log) -> dict | None:
    """The rate simulated at the speed its own decode-only steps ran (None without any)."""
    timed = sim_server.timed_steps(server, *real["window"], stats.num_total_blocks,
                                   stats.block_size)
    scale, with_prompts = run_speed(profile, timed), run_speed(profile, timed, True)
    nan = float("nan")
    log(f"  its decode-only steps ran at x{scale or nan:.3f} the fit's speed, its steps "
        f"with prompt tokens at x{with_prompts or nan:.3f} "
        f"(calibrated: x{profile.speed_scale:.3f})")
    if scale is None:
        return None
    return simulated(dataclasses.replace(profile, speed_scale=scale), config, specs, stats)


def _rows(rate: float, real: dict, sim: dict, tracked: dict | None,
          run_speed_columns: bool) -> list[dict]:
    """One row per figure, with the run's-speed columns when asked (NaN without
    ``tracked``)."""
    rows = []
    for fig in FIGURES:
        row = {"rate req/s": rate, "figure": fig, "measured": real[fig],
               "simulated": sim[fig], "error %": error_pct(real[fig], sim[fig])}
        if run_speed_columns:
            row[f"simulated {RUN_SPEED}"] = tracked[fig] if tracked else math.nan
            row[f"error % {RUN_SPEED}"] = error_pct(real[fig], row[f"simulated {RUN_SPEED}"])
        rows.append(row)
    return rows


def validate(profile: ExecutorProfile, w: Workload, rates: list[float] | None = None,
             seed: int = 0, log=print, calibrate: bool = True,
             calibrate_speed: bool = True, track_speed: bool = False) -> tuple[list[dict], dict]:
    """(rows: one per rate and figure, summary); starts and stops the server itself.
    ``calibrate``: scale the profile to the machine's speed in this run and add the
    server's measured overhead (``calibration``) before simulating. ``track_speed``: also
    simulate each rate at the speed its own decode-only steps ran (``run_speed``), in the
    rows' columns "... at the run's speed": what the error is once the machine's drift
    during the run is taken out. Not a validation on its own: TPOT is close to what that
    speed is read from."""
    started = time.perf_counter()
    config = SchedulerConfig(max_num_seqs=w.max_num_seqs)  # serve's defaults otherwise
    rows, counts = [], []
    with tempfile.TemporaryDirectory(prefix="sim-validate-") as tmp:
        server = sim_server.start(w, config, tmp)
        try:
            stats = server.stats()
            log(f"server ready: {stats.num_total_blocks} KV blocks of {stats.block_size} tokens "
                f"({time.perf_counter() - started:.0f} s)")
            if calibrate:
                profile = calibration(server, profile, config, stats, speed=calibrate_speed)
                log(_calibration_line(profile, calibrate_speed))
            rates = rates or [f * saturation_rps(profile, w) for f in w.fractions]
            for point, rate in enumerate(rates):
                specs = bench_specs(w, rate, seed + point)
                real = measured(server, specs)
                sim = simulated(profile, config, specs, stats)
                counts.append((real, sim))
                log(f"rate {rate:.3g} req/s: {len(specs)} requests measured and simulated "
                    f"({time.perf_counter() - started:.0f} s); steps measured "
                    f"{_steps_line(real)}, simulated {_steps_line(sim)}")
                tracked = (_at_run_speed(server, real, profile, config, specs, stats, log)
                           if track_speed else None)
                rows += _rows(rate, real, sim, tracked, track_speed)
        finally:
            server.stop()
    summary = _summary(rows, counts, time.perf_counter() - started)
    summary["link_overhead_ms"] = profile.link_overhead_s * 1e3
    summary["link_overhead_per_seq_ms"] = profile.link_overhead_per_seq_s * 1e3
    summary["speed_scale"] = profile.speed_scale
    summary["link_overhead_per_prompt_ms"] = profile.link_overhead_per_prompt_s * 1e3
    return rows, summary


COUNTS = ("requests", "completed", "refused", "step figures")


def _steps_line(figures: dict) -> str:
    f = figures["step figures"]
    stolen = f"; {f['cpu stolen %']:.1f} % of the CPU stolen" if "cpu stolen %" in f else ""
    cores = ", ".join(f"{k.removesuffix(' cores')} {v:.2f}" for k, v in f.items()
                      if k.endswith(" cores"))
    stolen += f"; cores held: {cores}" if cores else ""
    return (f"{f['steps']} of {f['mean step ms']:.1f} ms, {f['seqs a step']:.1f} sequences and "
            f"{f['prompt tokens'] / max(1, f['steps']):.0f} prompt tokens a step{stolen}")


def _errors(rows: list[dict], key: str = "error %") -> tuple[float, float]:
    """(median |error| over the finite figures (preemptions only where some happened),
    worst |error| of a p50), of column ``key``."""
    errs = [abs(r[key]) for r in rows if math.isfinite(r[key])
            and not (r["figure"] == "preemptions" and r["measured"] == r["simulated"] == 0)]
    p50 = [abs(r[key]) for r in rows if "p50" in r["figure"] and math.isfinite(r[key])]
    return (statistics.median(errs) if errs else float("nan"),
            max(p50) if p50 else float("nan"))


def _summary(rows: list[dict], counts, seconds: float) -> dict:
    median, p50 = _errors(rows)
    summary = {"median_abs_error_pct": median, "max_abs_p50_error_pct": p50,
               "counts": [{"measured": {k: r[k] for k in COUNTS},
                           "simulated": {k: s[k] for k in COUNTS}} for r, s in counts],
               "duration_s": seconds}
    if rows and f"error % {RUN_SPEED}" in rows[0]:
        summary["run_speed"] = dict(zip(("median_abs_error_pct", "max_abs_p50_error_pct"),
                                        _errors(rows, f"error % {RUN_SPEED}"), strict=True))
    return summary


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_validate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--profile", type=Path, required=True,
                   help="a fitted profile (python -m benchmarks.fit_profile)")
    p.add_argument("--quick", action="store_true", help="a few tiny requests per rate (CI)")
    p.add_argument("--rates", default=None,
                   help="requests/s, comma-separated (default: 0.4, 0.7, 1.0 of the "
                        "profile's predicted saturation)")
    p.add_argument("--json", type=Path, default=None, help="also write rows and summary")
    p.add_argument("--no-calibrate", action="store_true",
                   help="simulate with the in-process profile alone (no per-step overhead "
                        "measured from the server)")
    p.add_argument("--no-speed-calibration", action="store_true",
                   help="calibrate the overheads but keep the profile's speed (speed_scale 1)")
    p.add_argument("--speed-from-run", action="store_true",
                   help="also simulate each rate at the speed its own decode-only steps ran "
                        "(the server's telemetry): the error without the machine's drift "
                        "during the run; not a validation by itself, since TPOT is close to "
                        "what that speed is read from")
    args = p.parse_args(argv)
    try:
        args.rates = [float(r) for r in args.rates.split(",")] if args.rates else None
    except ValueError:
        p.error(f"--rates {args.rates!r}: comma-separated numbers")
    if args.rates and not all(0 < r < math.inf for r in args.rates):
        p.error("--rates: every rate must be > 0 requests/s")
    return args


def main(argv: list[str] | None = None) -> int:
    from sim import report

    args = parse_args(argv)
    try:
        profile = ExecutorProfile.load(args.profile)
    except ValueError as exc:
        print(f"sim_validate: --profile {exc}", file=sys.stderr)
        return 2
    w = QUICK if args.quick else Workload()
    print(profile.describe(), flush=True)
    rows, summary = validate(profile, w, args.rates, log=lambda m: print(m, flush=True),
                             calibrate=not args.no_calibrate,
                             calibrate_speed=not args.no_speed_calibration,
                             track_speed=args.speed_from_run)
    print(report.table(rows))
    for c in summary["counts"]:
        print(f"requests / completed / refused: measured {c['measured']}, "
              f"simulated {c['simulated']}")
    print(f"median |error| {summary['median_abs_error_pct']:.1f} % (target <= 10 %), worst p50 "
          f"|error| {summary['max_abs_p50_error_pct']:.1f} % (target <= 15 %); took "
          f"{summary['duration_s']:.0f} s")
    if "run_speed" in summary:
        t = summary["run_speed"]
        print(f"at each rate's own speed: median |error| {t['median_abs_error_pct']:.1f} %, "
              f"worst p50 |error| {t['max_abs_p50_error_pct']:.1f} %")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

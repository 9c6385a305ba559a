"""``python -m benchmarks.sim_validate``: the simulator against the real server.

``python -m sim --profile FILE --validate-against-server`` runs this as a process (sim/ may
import only the scheduler core; this needs the load generator and the wire).

One workload, built by ``continuum bench``'s own code (``bench_workload.build_workload``:
Azure conversation lengths × ``--length-scale``, Poisson arrivals) at three rates up to
saturation, each with a long-prompt burst (``burst`` prompts of ``long_len`` tokens that
arrive together half way through). Each rate runs once through a real ``continuum serve``
(started here on loopback ports, with its own internal secret; sent by ``bench_clients``,
summarized by ``bench_report``) and once through the simulator with the fitted profile:
the SAME requests (token ids, lengths, arrival times), the same scheduler config and the
server's own KV pool size (read from its Stats). Per rate it prints measured vs simulated
output throughput, TTFT p50/p99, TPOT p50/p99 and preemptions, with the error.

The rates are fractions of the saturation rate the profile predicts (``saturation_rps``),
so the same command fits any machine; ``--rates`` overrides them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.sim_server import Server, cpu_times, step_figures, stolen_pct
from scheduler_svc.core import SchedulerConfig
from sim.engine import Simulation
from sim.metrics import summarize
from sim.profile import ExecutorProfile
from sim.workload import TraceRequest

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
    from continuum.bench import add_arguments, validate_args
    from continuum.bench_workload import TOKEN_ID_RANGE, Spec, build_workload

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


def measured(server: Server, specs) -> dict:
    from continuum.bench_clients import GrpcClient, run_workload
    from continuum.bench_report import summarize_outcomes

    before = server.stats().num_preemptions

    async def go():
        client = GrpcClient(server.addr, None)
        try:
            return await run_workload(client, specs, None, progress=False)
        finally:
            await client.close()

    since, cpu, used = time.time(), cpu_times(), server.cpu_seconds()
    outcomes, duration = asyncio.run(go())
    steps = server.steps(since, time.time())
    steps["cpu stolen %"] = stolen_pct(cpu, cpu_times())
    wall = time.time() - since
    for name, seconds in server.cpu_seconds().items():  # cores each process held
        steps[f"{name} cores"] = (seconds - used.get(name, 0.0)) / wall
    s = summarize_outcomes(outcomes, duration, {})["overall"]
    return {"requests": len(specs), "completed": s["num_completed"],
            "refused": sum(s["errors"].values()), "output tok/s": s["output_throughput"],
            "TTFT p50 ms": s["ttft_median_ms"], "TTFT p99 ms": s["ttft_p99_ms"],
            "TPOT p50 ms": s["tpot_median_ms"], "TPOT p99 ms": s["tpot_p99_ms"],
            "preemptions": server.stats().num_preemptions - before, "step figures": steps,
            "window": (since, since + wall)}


CALIBRATION_BATCH = 24  # near the concurrency of the saturated rate (8-30 running)
CALIBRATION_PROMPTS = (32, 256)  # lone prefills: their TTFTs' difference gives the speed
CALIBRATION_REPEATS = 3  # each calibration's figure is the median of this many runs


def calibration(server: Server, profile: ExecutorProfile, config: SchedulerConfig,
                stats, output_tokens: int = 24, speed: bool = True) -> ExecutorProfile:
    """``profile`` calibrated on the running server (the calibrations also warm it up):

    * ``speed_scale``: the machine's speed now against the fit's. Lone prompts of the two
      ``CALIBRATION_PROMPTS`` lengths (fresh ids, so the prefix cache holds none), one
      output token each: the difference of their TTFTs over the profile's difference of
      their prefills (whatever TTFT holds besides the prefill cancels out); 1 when
      ``speed`` is False.
    * the server's overhead over the in-process profile (scheduler, ZeroMQ link, gateway
      stream): one lone request, and ``CALIBRATION_BATCH`` arriving together; each one's
      TPOT minus the scaled profile's decode step of that batch gives the overhead at 1
      and at ``CALIBRATION_BATCH`` sequences, and the line through them splits it into a
      per-step and a per-sequence part (each at least 0).
    * the cost of admitting a request (``link_overhead_per_prompt_s``: the gateway's and
      the scheduler's work for a new request, on the cores of the step that prefills
      it): the value at which the simulator, given the same batch, matches its measured
      TTFT p50 (bisection; 0 when it is already as slow).
    """
    from continuum.bench_workload import TOKEN_ID_RANGE, Spec

    rng = random.Random(7)

    def ids(n: int) -> list[int]:  # fresh: the prefix cache holds none of them
        return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)]

    def medians(specs, *figures: str) -> list[float]:
        """Each figure's median over CALIBRATION_REPEATS runs of fresh ``specs()``, in s."""
        runs = [measured(server, specs()) for _ in range(CALIBRATION_REPEATS)]
        out = []
        for figure in figures:
            values = [r[figure] / 1e3 for r in runs if math.isfinite(r[figure])]
            out.append(statistics.median(values) if values else math.nan)
        return out

    def lone_prompt(n: int):
        return lambda: [Spec(index=0, arrival_s=0.0, max_tokens=1, prompt_ids=ids(n))]

    def batch(n: int):
        return lambda: [Spec(index=i, arrival_s=0.0, prompt_ids=ids(16),
                             max_tokens=output_tokens) for i in range(n)]

    fit = dataclasses.replace(profile, speed_scale=1.0, link_overhead_s=0.0,
                              link_overhead_per_seq_s=0.0, link_overhead_per_prompt_s=0.0)
    short, long = CALIBRATION_PROMPTS
    ttft = [medians(lone_prompt(n), "TTFT p50 ms")[0] for n in CALIBRATION_PROMPTS]
    scale = (ttft[1] - ttft[0]) / (fit.prefill_time(long) - fit.prefill_time(short))
    scaled = dataclasses.replace(fit, speed_scale=scale if speed and 0 < scale < math.inf
                                 else 1.0)

    def overhead(tpot: float, n: int) -> float:
        predicted = scaled.decode_step_time(n, 16 + output_tokens // 2)
        return max(0.0, tpot - predicted) if math.isfinite(tpot) else 0.0

    together = batch(CALIBRATION_BATCH)
    [lone_tpot] = medians(batch(1), "TPOT p50 ms")
    many_tpot, target = medians(together, "TPOT p50 ms", "TTFT p50 ms")
    one, many = overhead(lone_tpot, 1), overhead(many_tpot, CALIBRATION_BATCH)
    per_seq = max(0.0, (many - one) / (CALIBRATION_BATCH - 1))
    served = dataclasses.replace(scaled, link_overhead_s=max(0.0, one - per_seq),
                                 link_overhead_per_seq_s=per_seq)
    return admission_fitted(served, together(), target, config, stats)


MAX_PROMPT_OVERHEAD_S = 0.25


def admission_fitted(served: ExecutorProfile, specs, target_ttft_s: float,
                     config: SchedulerConfig, stats) -> ExecutorProfile:
    """``served`` with the ``link_overhead_per_prompt_s`` at which simulating ``specs``
    gives their measured TTFT p50 (bisection over [0, MAX_PROMPT_OVERHEAD_S]); unchanged
    when the simulation is already as slow, or nothing was measured."""
    def ttft_at(per_prompt: float) -> float:
        candidate = dataclasses.replace(served, link_overhead_per_prompt_s=per_prompt)
        return simulated(candidate, config, specs, stats)["TTFT p50 ms"] / 1e3

    lo, hi = 0.0, MAX_PROMPT_OVERHEAD_S
    if not math.isfinite(target_ttft_s) or ttft_at(lo) >= target_ttft_s:
        return served
    for _ in range(16):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ttft_at(mid) < target_ttft_s else (lo, mid)
    return dataclasses.replace(served, link_overhead_per_prompt_s=(lo + hi) / 2)


def simulated(profile: ExecutorProfile, config: SchedulerConfig, specs, stats) -> dict:
    reqs = [TraceRequest(s.arrival_s, len(s.prompt_ids), s.max_tokens, tenant=s.tenant,
                         priority_tier=s.tier, prompt_ids=tuple(s.prompt_ids)) for s in specs]
    res = Simulation(reqs, config, profile, num_blocks=stats.num_total_blocks,
                     num_host_blocks=0, max_model_len=stats.max_model_len,
                     vocab=stats.vocab_size,
                     pipeline_depth=2 if config.async_scheduling else 1).run()
    if stats.block_size != 16:
        raise RuntimeError(f"the server's block size is {stats.block_size}; the simulator's 16")
    s = summarize([r.timing() for r in res.finished], duration_s=res.end_s or None)
    return {"requests": len(specs), "completed": len(res.finished), "refused": len(res.rejected),
            "output tok/s": res.num_output_tokens / res.end_s if res.end_s else 0.0,
            "TTFT p50 ms": s["ttft_median_ms"], "TTFT p99 ms": s["ttft_p99_ms"],
            "TPOT p50 ms": s["tpot_median_ms"], "TPOT p99 ms": s["tpot_p99_ms"],
            "preemptions": res.num_preemptions,
            "step figures": step_figures(res.num_steps, res.busy_s, res.num_step_seqs,
                                         res.num_prefill_tokens)}


def error_pct(real: float, sim: float) -> float:
    if real == sim:
        return 0.0
    if not real or math.isnan(real) or math.isnan(sim):
        return float("nan")
    return 100.0 * (sim / real - 1.0)


def run_speed(profile: ExecutorProfile, steps, prompts: bool = False) -> float | None:
    """The speed one rate's own steps ran at against the fit's: the median over its
    decode-only steps (``prompts``: over those with prompt tokens instead) of (measured
    time - ``profile``'s calibrated overheads) / the fit's time at speed 1. ``steps``:
    (seconds, decodes, prompt tokens, KV tokens held); each decode's context is the KV
    held / the sequences, and a step's prompt tokens are priced as one new prompt. None
    without any such step."""
    fit = dataclasses.replace(profile, speed_scale=1.0, link_overhead_s=0.0,
                              link_overhead_per_seq_s=0.0, link_overhead_per_prompt_s=0.0)
    ratios = []
    for seconds, decodes, prompt, kv in steps:
        if bool(prompt) != prompts:
            continue
        context = max(1, kv // max(1, decodes + (prompt > 0)))
        base = fit.step_time([(1, context)] * decodes + ([(prompt, 0)] if prompt else []))
        if base > 0:
            sampled = decodes + (prompt > 0)
            overhead = profile.link_overhead_s + profile.link_overhead_per_seq_s * sampled
            ratios.append((seconds - overhead) / base)
    scale = statistics.median(ratios) if ratios else None
    return scale if scale is not None and 0 < scale < math.inf else None


RUN_SPEED = "at the run's speed"


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
        server = Server(w, config, tmp)
        try:
            server.wait_ready()
            stats = server.stats()
            log(f"server ready: {stats.num_total_blocks} KV blocks of {stats.block_size} tokens "
                f"({time.perf_counter() - started:.0f} s)")
            if calibrate:
                profile = calibration(server, profile, config, stats, speed=calibrate_speed)
                speed = (f"its machine runs the profile's steps x {profile.speed_scale:.3f} "
                         f"(lone prefills of {CALIBRATION_PROMPTS[0]} and "
                         f"{CALIBRATION_PROMPTS[1]} tokens)" if calibrate_speed else
                         "the profile's speed kept (--no-speed-calibration)")
                log(f"calibrated on the server: {speed}; its overhead over the profile "
                    f"{profile.link_overhead_s * 1e3:.2f} ms a step + "
                    f"{profile.link_overhead_per_seq_s * 1e3:.2f} ms a sequence (TPOT of 1 "
                    f"and of {CALIBRATION_BATCH} requests minus the scaled decode steps) + "
                    f"{profile.link_overhead_per_prompt_s * 1e3:.2f} ms a new prompt (where "
                    f"the simulated TTFT of {CALIBRATION_BATCH} together meets the measured)")
            rates = rates or [f * saturation_rps(profile, w) for f in w.fractions]
            for point, rate in enumerate(rates):
                specs = bench_specs(w, rate, seed + point)
                real = measured(server, specs)
                sim = simulated(profile, config, specs, stats)
                counts.append((real, sim))
                log(f"rate {rate:.3g} req/s: {len(specs)} requests measured and simulated "
                    f"({time.perf_counter() - started:.0f} s); steps measured "
                    f"{_steps_line(real)}, simulated {_steps_line(sim)}")
                tracked = None
                if track_speed:
                    timed = server.timed_steps(*real["window"], stats.num_total_blocks,
                                               stats.block_size)
                    scale, with_prompts = run_speed(profile, timed), run_speed(profile, timed, True)
                    if scale is not None:
                        tracked = simulated(dataclasses.replace(profile, speed_scale=scale),
                                            config, specs, stats)
                    nan = float("nan")
                    log(f"  its decode-only steps ran at x{scale or nan:.3f} the fit's speed, "
                        f"its steps with prompt tokens at x{with_prompts or nan:.3f} "
                        f"(calibrated: x{profile.speed_scale:.3f})")
                for fig in FIGURES:
                    row = {"rate req/s": rate, "figure": fig, "measured": real[fig],
                           "simulated": sim[fig], "error %": error_pct(real[fig], sim[fig])}
                    if track_speed:
                        row[f"simulated {RUN_SPEED}"] = tracked[fig] if tracked else math.nan
                        row[f"error % {RUN_SPEED}"] = error_pct(real[fig],
                                                                row[f"simulated {RUN_SPEED}"])
                    rows.append(row)
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

"""The profile calibrated on the server, and the simulator's side of one rate (for
``benchmarks.sim_validate``): ``simulated`` replays a rate's requests through the
simulator; ``calibration`` scales the fitted profile to the running server (its speed,
its overheads, the cost of admitting a request); ``run_speed`` reads the speed one rate's
own steps ran at from the server's telemetry (``--speed-from-run``)."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

from benchmarks.sim_server import measured, step_figures
from harness.servers import Serve
from scheduler_svc.core import SchedulerConfig
from sim.engine import Simulation
from sim.metrics import summarize
from sim.profile import ExecutorProfile
from sim.workload import TraceRequest


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


CALIBRATION_BATCH = 24  # near the concurrency of the saturated rate (8-30 running)
CALIBRATION_PROMPTS = (32, 256)  # lone prefills: their TTFTs' difference gives the speed
CALIBRATION_REPEATS = 3  # each calibration's figure is the median of this many runs


def calibration(server: Serve, profile: ExecutorProfile, config: SchedulerConfig,
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
    from continuum.bench.workload import TOKEN_ID_RANGE, Spec

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

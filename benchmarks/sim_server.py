"""The real server side of ``benchmarks.sim_validate`` (and ``benchmarks.capacity_check``):
``continuum serve`` (harness/servers.py) with a telemetry store, and what is read of it
while a workload runs: its Stats, the steps its telemetry store recorded,
the CPU its processes held, and the machine's CPU steal; ``measured`` runs one rate's
requests through it and returns the client's figures with those readings."""

from __future__ import annotations

import asyncio
import math
import os
import pathlib
import time

from harness import servers
from scheduler_svc.core import SchedulerConfig

TELEMETRY = "telemetry.sqlite"  # in the server's workdir: the steps, per rate


def start(w, config: SchedulerConfig, tmp: str) -> servers.Serve:
    """``continuum serve`` for ``w`` (a ``sim_validate.Workload``: its KV pool size) and
    ``config``'s policy and budgets, its telemetry store in ``tmp``."""
    return servers.start_serve(
        pathlib.Path(tmp), "--telemetry-dsn", os.path.join(tmp, TELEMETRY),
        "--kv-cache-bytes", str(w.kv_cache_bytes), "--policy", config.policy,
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--chunk-size", str(config.chunk_size), http=False, timeout_s=300)


def _iterations(server: servers.Serve, since: float, until: float) -> list[tuple]:
    """The scheduler's step records between two wall times (its telemetry store):
    (recorded_at, latency s, seqs, prompt tokens, free KV blocks, decode tokens), in
    order."""
    import sqlite3

    deadline = time.monotonic() + 5  # the store's writer batches its inserts
    while True:
        with sqlite3.connect(server.workdir / TELEMETRY) as db:
            rows = db.execute(
                "SELECT recorded_at, step_latency_ms / 1e3, num_seqs, num_prefill_tokens, "
                "num_free_blocks, num_decode_tokens FROM scheduler_iterations "
                "WHERE recorded_at >= ? AND recorded_at <= ? ORDER BY recorded_at",
                (since, until)).fetchall()
        if (rows and rows[-1][0] >= until - 1.0) or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def steps(server: servers.Serve, since: float, until: float) -> dict:
    """The steps recorded between two wall times: how many, their mean time, mean
    batch, prompt tokens. A step's time is the gap since the previous record, or its
    own latency (plan sent to answer) where that is shorter: the gap holds any idle
    wait before it, the latency any queueing behind the step before it (plans are
    sent a step ahead)."""
    rows = _iterations(server, since, until)
    busy = sum(min(b[0] - a[0], b[1]) for a, b in zip(rows, rows[1:], strict=False))
    busy += rows[0][1] if rows else 0.0
    return step_figures(len(rows), busy, sum(r[2] for r in rows), sum(r[3] for r in rows))


def timed_steps(server: servers.Serve, since: float, until: float, num_blocks: int,
                block_size: int) -> list[tuple[float, int, int, int]]:
    """The steps between two wall times, timed as ``steps`` times them: (seconds,
    decode tokens, prompt tokens, KV tokens held: the pool's blocks in use x block
    size)."""
    rows = _iterations(server, since, until)
    return [(min(b[0] - a[0], b[1]), b[5], b[3], (num_blocks - b[4]) * block_size)
            for a, b in zip(rows, rows[1:], strict=False) if b[2]]


def cpu_times() -> list[int] | None:
    """The machine's CPU time counters (/proc/stat's first line), None where there is none."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def stolen_pct(before: list[int] | None, after: list[int] | None) -> float:
    """Of the CPU time between two readings, the share the hypervisor gave to other guests
    (steal, the 8th counter): a virtual machine's noisy neighbours, which no profile holds."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return math.nan
    total = sum(after) - sum(before)
    return 100.0 * (after[7] - before[7]) / total if total > 0 else math.nan


def step_figures(steps: int, busy_s: float, seqs: int, prefill: int) -> dict:
    return {"steps": steps, "mean step ms": 1e3 * busy_s / steps if steps else 0.0,
            "seqs a step": seqs / steps if steps else 0.0, "prompt tokens": prefill}


def measured(server: servers.Serve, specs) -> dict:
    from continuum.bench.clients import GrpcClient, run_workload
    from continuum.bench.report import summarize_outcomes

    before = server.stats().num_preemptions

    async def go():
        client = GrpcClient(server.addr, None)
        try:
            return await run_workload(client, specs, None, progress=False)
        finally:
            await client.close()

    since, cpu, used = time.time(), cpu_times(), server.cpu_seconds()
    outcomes, duration = asyncio.run(go())
    figures = steps(server, since, time.time())
    figures["cpu stolen %"] = stolen_pct(cpu, cpu_times())
    wall = time.time() - since
    for name, seconds in server.cpu_seconds().items():  # cores each process held
        figures[f"{name} cores"] = (seconds - used.get(name, 0.0)) / wall
    s = summarize_outcomes(outcomes, duration, {})["overall"]
    return {"requests": len(specs), "completed": s["num_completed"],
            "refused": sum(s["errors"].values()), "output tok/s": s["output_throughput"],
            "TTFT p50 ms": s["ttft_median_ms"], "TTFT p99 ms": s["ttft_p99_ms"],
            "TPOT p50 ms": s["tpot_median_ms"], "TPOT p99 ms": s["tpot_p99_ms"],
            "preemptions": server.stats().num_preemptions - before, "step figures": figures,
            "window": (since, since + wall)}

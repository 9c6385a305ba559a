"""The real server side of ``benchmarks.sim_validate`` (and ``benchmarks.capacity_check``):
``continuum serve`` started on free loopback ports with its own internal secret, and what
is read of it while a workload runs: its Stats, the steps its telemetry store recorded,
the CPU its processes held, and the machine's CPU steal; ``measured`` runs one rate's
requests through it and returns the client's figures with those readings."""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from continuum.procs import free_port
from scheduler_svc.core import SchedulerConfig


class Server:
    """``continuum serve`` on free loopback ports; ``stats()`` over the internal plane."""

    def __init__(self, w, config: SchedulerConfig, tmp: str) -> None:
        """``w``: a ``sim_validate.Workload`` (its KV pool size); ``tmp``: a directory
        for the socket and the telemetry store."""
        from runtime import internal_auth

        self.secret = os.environ.get(internal_auth.ENV_SECRET) or secrets.token_hex(24)
        self._metadata = internal_auth.metadata(self.secret.encode())
        self.port, self.sched_port = free_port(), free_port()
        self.telemetry = os.path.join(tmp, "telemetry.sqlite")  # the steps, per rate
        env = {**os.environ, internal_auth.ENV_SECRET: self.secret}
        env.pop(internal_auth.ENV_SECRET_FILE, None)
        cmd = [sys.executable, "-m", "continuum", "serve", "--port", str(self.port),
               "--scheduler-port", str(self.sched_port), "--http-port", "-1",
               "--ipc", f"ipc://{tmp}/executor.sock", "--telemetry-dsn", self.telemetry,
               "--kv-cache-bytes", str(w.kv_cache_bytes), "--policy", config.policy,
               "--max-num-seqs", str(config.max_num_seqs),
               "--max-num-batched-tokens", str(config.max_num_batched_tokens),
               "--chunk-size", str(config.chunk_size)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        ready = threading.Event()
        threading.Thread(target=lambda: ready.set() if self.proc.stdout.readline() else None,
                         daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("continuum serve did not become ready:\n"
                                   + "".join(self.stderr[-20:]))

    def stats(self):
        import grpc

        from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.sched_port}") as ch:
            return scheduler_pb2_grpc.SchedulerStub(ch).Stats(
                scheduler_pb2.StatsRequest(), timeout=10, metadata=self._metadata)

    def _iterations(self, since: float, until: float) -> list[tuple]:
        """The scheduler's step records between two wall times (its telemetry store):
        (recorded_at, latency s, seqs, prompt tokens, free KV blocks, decode tokens), in
        order."""
        import sqlite3

        deadline = time.monotonic() + 5  # the store's writer batches its inserts
        while True:
            with sqlite3.connect(self.telemetry) as db:
                rows = db.execute(
                    "SELECT recorded_at, step_latency_ms / 1e3, num_seqs, num_prefill_tokens, "
                    "num_free_blocks, num_decode_tokens FROM scheduler_iterations "
                    "WHERE recorded_at >= ? AND recorded_at <= ? ORDER BY recorded_at",
                    (since, until)).fetchall()
            if (rows and rows[-1][0] >= until - 1.0) or time.monotonic() > deadline:
                return rows
            time.sleep(0.5)

    def steps(self, since: float, until: float) -> dict:
        """The steps recorded between two wall times: how many, their mean time, mean
        batch, prompt tokens. A step's time is the gap since the previous record, or its
        own latency (plan sent to answer) where that is shorter: the gap holds any idle
        wait before it, the latency any queueing behind the step before it (plans are
        sent a step ahead)."""
        rows = self._iterations(since, until)
        busy = sum(min(b[0] - a[0], b[1]) for a, b in zip(rows, rows[1:], strict=False))
        busy += rows[0][1] if rows else 0.0
        return step_figures(len(rows), busy, sum(r[2] for r in rows), sum(r[3] for r in rows))

    def timed_steps(self, since: float, until: float, num_blocks: int,
                    block_size: int) -> list[tuple[float, int, int, int]]:
        """The steps between two wall times, timed as ``steps`` times them: (seconds,
        decode tokens, prompt tokens, KV tokens held: the pool's blocks in use x block
        size)."""
        rows = self._iterations(since, until)
        return [(min(b[0] - a[0], b[1]), b[5], b[3], (num_blocks - b[4]) * block_size)
                for a, b in zip(rows, rows[1:], strict=False) if b[2]]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of serve's processes, by module: the
        executor, and what shares its cores with it here (scheduler, gateway)."""
        out: dict[str, float] = {}
        pending = [self.proc.pid]
        while pending:
            pid = pending.pop()
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    pending += [int(c) for c in f.read().split()]
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, ValueError):
                continue
            name = next((a.decode() for a in argv if a.endswith((b"_svc", b"gateway"))), None)
            if name and pid != self.proc.pid:
                out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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

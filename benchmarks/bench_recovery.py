"""What a client sees when the executor dies or hangs under load (docs/reliability.md).

``continuum serve`` (``--standby-executors 1`` unless told otherwise), N greedy gRPC
streams, then ``--repeats`` times each, once a standby is registered again: kill -9 the
executor (per stream, the kill to its first token after it), and SIGSTOP it (the time
until the scheduler logs the detach, and per stream the stop to its first token after).
Percentiles are over every stream of every repeat. Serve's crash-loop guard gets twice the
bench's fault count; if the server stops anyway the bench says so and exits non-zero.

    make bench-recovery   # or: .venv/bin/python -m benchmarks.bench_recovery [--streams 16]
        [--max-tokens 96] [--repeats 3] [--standby-executors 1] [--max-executor-restarts N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import math
import os
import pathlib
import signal
import sys
import tempfile
import time

import grpc

from continuum.serve.config import ServeConfig
from harness import servers
from harness.streams import request
from sim.metrics import percentile

DETACH_LOGS = ("executor missed its step deadline", "executor stopped answering heartbeats",
               "executor disconnected")
GUARD_FLAG = servers.GUARD_FLAG


def restart_budget(repeats: int, given: int | None = None) -> tuple[int, list[str]]:
    """(faults this run injects, serve's crash-loop guard flags that fit them): twice the
    faults unless ``given``, so that a replacement a busy machine loses too still fits."""
    faults = 2 * repeats
    return faults, [GUARD_FLAG, str(2 * faults if given is None else given)]


def stream(server, request, arrivals: list[float]) -> None:
    with grpc.insecure_channel(server.addr) as ch:
        for response in server.generation_stub(ch).Generate(request, timeout=600):
            if response.token_ids:
                arrivals.append(time.monotonic())


def wait_for_executors(server, standby: bool, timeout: float = 300.0) -> tuple[int, int]:
    """(executor pid, standby pid) once an executor serves (and a standby is registered)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats.executor_pid and (stats.standby_executor_pid or not standby):
            return stats.executor_pid, stats.standby_executor_pid
        time.sleep(0.1)
    raise SystemExit("no executor (or standby) registered within the timeout")


def memory_mib(pid: int) -> dict[str, float]:
    """Rss, Pss and Shared_Clean+Shared_Dirty of ``pid`` in MiB (/proc/PID/smaps_rollup)."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0]) / 1024
    return {"rss": fields.get("Rss", 0.0), "pss": fields.get("Pss", 0.0),
            "shared": fields.get("Shared_Clean", 0.0) + fields.get("Shared_Dirty", 0.0)}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def describe_standby(server, idle_s: float = 10.0) -> None:
    """What a registered, idle standby costs: memory beside the executor's, CPU over
    ``idle_s`` seconds."""
    active, standby = wait_for_executors(server, True)
    time.sleep(15)  # its last start-up work (the grammar tokenizer) runs after its Hello
    before = cpu_s(standby)
    time.sleep(idle_s)
    used = cpu_s(standby) - before
    for name, pid in (("executor", active), ("standby", standby)):
        m = memory_mib(pid)
        print(f"{name} pid {pid}: RSS {m['rss']:.0f} MiB, PSS {m['pss']:.0f} MiB, "
              f"shared {m['shared']:.0f} MiB")
    print(f"idle standby CPU: {used:.2f} s over {idle_s:.0f} s ({100 * used / idle_s:.1f} %)")


def run_fault(server, streams: int, max_tokens: int, fault) -> tuple[list[float], float]:
    """Returns (per stream: fault → first token after it, in s; detach logged after s)."""
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    requests = [request(f"Tell a long story about the number {i}.", max_tokens)
                for i in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(stream, server, r, a) for r, a in zip(requests, arrivals,
                                                                        strict=True)]
        deadline = time.monotonic() + 300
        while (min(len(a) for a in arrivals) < 8 and time.monotonic() < deadline
               and not any(f.done() for f in futures)):  # one ended early: an error
            time.sleep(0.01)
        log_mark = len(server.log)
        at = time.monotonic()
        fault()
        detected = math.nan
        while not all(f.done() for f in futures):
            if math.isnan(detected) and any(
                    m in line for line in server.log[log_mark:] for m in DETACH_LOGS):
                detected = time.monotonic() - at
            time.sleep(0.005)
        for f in futures:
            f.result()
    resumed = [next(t for t in times if t > at) - at for times in arrivals
               if times and times[-1] > at]
    return resumed, detected


def describe(values: list[float]) -> str:
    return (f"p50 {percentile(values, 50):.2f} s, p99 {percentile(values, 99):.2f} s "
            f"over {len(values)} streams")


def measure(server, args: argparse.Namespace) -> None:
    """The faults and the figures (the module's docstring)."""
    standby = bool(args.standby_executors)
    if standby:
        describe_standby(server)
    killed: list[float] = []
    for _ in range(args.repeats):
        pid, _ = wait_for_executors(server, standby)
        resumed, _ = run_fault(server, args.streams, args.max_tokens,
                               lambda pid=pid: os.kill(pid, signal.SIGKILL))
        killed += resumed
    hung_resumed: list[float] = []
    detections: list[float] = []
    for _ in range(args.repeats):
        hung, _ = wait_for_executors(server, standby)
        try:
            resumed, detected = run_fault(server, args.streams, args.max_tokens,
                                          lambda hung=hung: os.kill(hung, signal.SIGSTOP))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)
        hung_resumed += resumed
        detections.append(detected)
    mode = "warm standby" if standby else "cold restart (no standby)"
    print(f"recovery, {mode}, {args.streams} streams x {args.repeats} repeats")
    print(f"kill -9 executor → first resumed token: {describe(killed)}")
    print(f"SIGSTOP executor → detach logged: p50 {percentile(detections, 50):.2f} s, "
          f"max {max(detections):.2f} s over {len(detections)} hangs")
    print(f"SIGSTOP executor → first resumed token: {describe(hung_resumed)}")
    stats = server.stats()
    print(f"standby takeovers: {stats.num_standby_takeovers}, executor losses: "
          f"{stats.num_executor_losses}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--standby-executors", type=int, choices=(0, 1), default=1)
    p.add_argument(GUARD_FLAG, type=int, default=None,
                   help="serve's crash-loop budget (default: twice this run's faults)")
    p.add_argument("--server-log", default=None, help="write the server's stderr here")
    args = p.parse_args()
    faults, guard = restart_budget(args.repeats, args.max_executor_restarts)
    print(f"{faults} faults; serve's crash-loop guard: {' '.join(guard)} within "
          f"--restart-window-s {ServeConfig().restart_window_s:g} (its default)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            server = servers.start_serve(
                pathlib.Path(tmp), "--kv-cache-bytes", str(96 << 20),
                "--standby-executors", str(args.standby_executors), *guard,
                # every stream must run: none shed for its queue time
                "--max-queue-time-standard-s", "0")
        except servers.ServerError as exc:
            raise SystemExit(f"bench_recovery: {exc}") from None
        try:
            try:
                measure(server, args)
            except grpc.RpcError as exc:
                raise SystemExit(f"bench_recovery: {server.why_stopped(exc)}") from None
        except BaseException:
            print("".join(server.log[-60:]), file=sys.stderr)  # the server's side
            raise
        finally:
            server.stop()
            if args.server_log:
                pathlib.Path(args.server_log).write_text("".join(server.log))


if __name__ == "__main__":
    main()

"""What a client sees when the executor dies or hangs under load.

Starts the real server (``continuum serve`` with the bundled model, as the
integration tests do), streams N greedy requests over gRPC, and once they all
have tokens:

* kill -9 the executor: per stream, the gap between the last token before the
  kill and the first token after it (the supervisor starts a new executor, the
  scheduler resumes every sequence by recompute);
* SIGSTOP the executor (a hang): the time until the scheduler logs the detach
  (step deadline missed, or heartbeats unanswered), and the per-stream gap.

    .venv/bin/python -m benchmarks.bench_recovery [--streams 16] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import pathlib
import signal
import statistics
import tempfile
import time

import grpc

from tests.integration.conftest import start_server, stop_server
from tests.integration.test_faults import executor_pid
from tests.integration.test_serve import chat

DETACH_LOGS = ("executor missed its step deadline", "executor stopped answering heartbeats",
               "executor disconnected")


def stream(server, request, arrivals: list[float]) -> None:
    with grpc.insecure_channel(server.addr) as ch:
        for response in server.generation_stub(ch).Generate(request, timeout=600):
            if response.token_ids:
                arrivals.append(time.monotonic())


def run_fault(server, streams: int, max_tokens: int, fault) -> tuple[float, list[float], float]:
    """Returns (fault time, per-stream gaps across it in s, detection time or nan)."""
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    requests = [chat(f"Tell a long story about the number {i}.", max_tokens=max_tokens,
                     ignore_eos=True) for i in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(stream, server, r, a) for r, a in zip(requests, arrivals,
                                                                        strict=True)]
        deadline = time.monotonic() + 300
        while min(len(a) for a in arrivals) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        log_mark = len(server.stderr_lines)
        at = time.monotonic()
        fault()
        detected = float("nan")
        while not all(f.done() for f in futures):
            if detected != detected and any(
                    m in line for line in server.stderr_lines[log_mark:] for m in DETACH_LOGS):
                detected = time.monotonic() - at
            time.sleep(0.005)
        for f in futures:
            f.result()
    gaps = []
    for times in arrivals:
        before = [t for t in times if t <= at]
        after = [t for t in times if t > at]
        if before and after:
            gaps.append(after[0] - before[-1])
    return at, gaps, detected


def describe(gaps: list[float]) -> str:
    return (f"median {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s "
            f"over {len(gaps)} streams")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    from executor_svc.model_files import resolve_model
    from executor_svc.settings import Switches
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(pathlib.Path(tmp), resolve_model(None, Switches.from_env().cache_dir))
        try:
            pid = executor_pid(server)
            _, gaps, _ = run_fault(server, args.streams, args.max_tokens,
                                   lambda: os.kill(pid, signal.SIGKILL))
            print(f"kill -9 executor: last token before → first token after: {describe(gaps)}")

            hung = executor_pid(server)
            try:
                _, gaps, detected = run_fault(server, args.streams, args.max_tokens,
                                              lambda: os.kill(hung, signal.SIGSTOP))
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(hung, signal.SIGCONT)
            print(f"SIGSTOP executor: detach logged after {detected:.2f} s; "
                  f"last token before → first token after: {describe(gaps)}")
        finally:
            stop_server(server)


if __name__ == "__main__":
    main()

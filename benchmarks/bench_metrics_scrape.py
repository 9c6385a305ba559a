"""Scrape latency of the replica's /metrics while the server is under full load.

GIE's endpoint picker scrapes every 50 ms and treats a page older than 200 ms as a
saturated pod, so we hold a scrape to a p99 under 10 ms at full load. This starts
`continuum serve --metrics-port`, keeps ``--streams`` greedy streams running back to
back, scrapes every 50 ms for ``--seconds``, and prints the scrape latency p50/p99/max
and the page's age (now minus continuum:metrics_published_timestamp_seconds).

The scraper runs in a process of its own, as Prometheus and the endpoint picker do: in
this one its latency would include waiting for the GIL behind the 32 load threads. It
keeps its connection open as they do (``--no-keep-alive``: a new one per scrape).

    .venv/bin/python -m benchmarks.bench_metrics_scrape [--streams 32] [--seconds 20]
"""

from __future__ import annotations

import argparse
import http.client
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from harness import servers
from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc
from sim.metrics import percentile


def _load(addr: str, stop: threading.Event) -> None:
    with grpc.insecure_channel(addr) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while not stop.is_set():
            request = gen.GenerateRequest(prompt="Tell me a long story.", max_tokens=64,
                                          sampling={"temperature": 0.0, "ignore_eos": True})
            try:
                list(stub.Generate(request, timeout=120))
            except grpc.RpcError:
                time.sleep(0.5)  # refused under overload: the load stays at the bound


def scrape(port: int, seconds: float, keep_alive: bool) -> dict[str, list[float]]:
    """Scrapes every 50 ms for ``seconds``: latencies (s), page ages (s), running."""
    latencies, ages, running = [], [], []
    conn = None
    end = time.monotonic() + seconds
    while not latencies or time.monotonic() < end:  # at least one scrape
        start = time.perf_counter()
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        if not keep_alive:
            conn.close()
            conn = None
        latencies.append(time.perf_counter() - start)
        for line in text.splitlines():
            if line.startswith("continuum:metrics_published_timestamp_seconds{"):
                ages.append(time.time() - float(line.rsplit(" ", 1)[1]))
            elif line.startswith("vllm:num_requests_running{"):
                running.append(float(line.rsplit(" ", 1)[1]))
        time.sleep(0.05)
    return {"latencies": latencies, "ages": ages, "running": running}


def _wait_for_load(port: int, streams: int, timeout_s: float = 300.0) -> None:
    """Until the page shows the batch full (half the streams running): the executor may
    still be warming up when serve says ready, on a busy machine for minutes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = scrape(port, 0.0, keep_alive=False)["running"]
        if running and running[0] >= streams // 2:
            return
        time.sleep(0.5)
    raise SystemExit(f"the load never filled the batch within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_metrics_scrape")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--no-keep-alive", action="store_true")
    p.add_argument("--scrape-only", type=int, metavar="PORT", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.scrape_only:  # the scraper process
        print(json.dumps(scrape(a.scrape_only, a.seconds, not a.no_keep_alive)))
        return 0
    port = servers.free_port()
    serve = servers.start_serve(pathlib.Path(tempfile.mkdtemp()), "--metrics-port", str(port),
                              "--telemetry-dsn", "off")
    stop = threading.Event()
    try:
        threads = [threading.Thread(target=_load, args=(serve.addr, stop), daemon=True)
                   for _ in range(a.streams)]
        for t in threads:
            t.start()
        _wait_for_load(port, a.streams)
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_metrics_scrape", "--scrape-only",
             str(port), "--seconds", str(a.seconds),
             *(["--no-keep-alive"] if a.no_keep_alive else [])],
            capture_output=True, text=True, check=True).stdout
        got = json.loads(out)
        ages, running = got["ages"], got["running"]
        ms = [x * 1e3 for x in got["latencies"]]
        print(f"{len(ms)} scrapes ({'new connection each' if a.no_keep_alive else 'keep-alive'})"
              f" under {a.streams} streams (running p50 "
              f"{percentile(running, 50):.0f}): latency p50 {percentile(ms, 50):.2f} ms, "
              f"p99 {percentile(ms, 99):.2f} ms, max {max(ms):.2f} ms; page age p50 "
              f"{percentile(ages, 50) * 1e3:.0f} ms, p99 {percentile(ages, 99) * 1e3:.0f} ms "
              f"(target: p99 latency < 10 ms, age < 200 ms)")
    finally:
        stop.set()
        serve.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

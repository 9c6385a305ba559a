"""Continuum against llama.cpp's ``llama-server`` on one machine (docs/benchmarks.md's table):
the same token-id prompts, greedy, ``ignore_eos``, through the same OpenAI client, at 1, 8,
32 and 64 concurrent streams, the two servers alternating; one markdown table and whether
each ``TARGET_RATIO`` was met (``--json``: every figure). Serve llama-server the bundled
GGUF and restart it before each run (its slots keep each prompt's KV). Ours is started here
with ``make run``'s defaults unless ``--ours-url`` names a running one.

    gguf=$(python -c 'import executor_svc.model_files as m; print(m.bundled_gguf())')
    llama-server -m "$gguf" -np 64 --cont-batching -c 65536 --port 8080
    .venv/bin/python -m benchmarks.vs_llama_server --llama-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import tempfile
import time

from benchmarks.bench_serve import parse_bench
from continuum.bench.run import run_point
from harness import servers

# What we aim for: our output tok/s over llama-server's, at least, by streams.
TARGET_RATIO = {1: 1.0, 8: 2.0, 32: 3.0, 64: 3.0}


def _point(base_url: str, streams: int, args: argparse.Namespace) -> dict:
    bench = parse_bench(
        "--api", "openai", "--base-url", base_url, "--dataset", "fixed",
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--num-prompts", str(max(streams * args.prompts_per_stream, 2)),
        "--max-concurrency", str(streams), "--seed", str(args.seed + streams))
    report, _ = asyncio.run(run_point(bench, float("inf"), 0))
    overall = report["overall"]
    if not overall["num_completed"]:
        raise SystemExit(f"{base_url}: 0 of {overall['num_requests']} requests completed "
                         f"at {streams} streams (errors: {overall['errors']})")
    return overall


@contextlib.contextmanager
def _ours(url: str | None, extra: list[str]):
    """Yields (our base URL, {role: pid} of our processes or None): ``url`` as given, or
    a ``continuum serve`` started here with make run's defaults (``--policy chunked`` is
    serve's default: it only keeps ``start_serve`` from substituting its small test pool
    for them)."""
    if url:
        yield url, None
        return
    with tempfile.TemporaryDirectory(prefix="continuum-vs-llama-") as tmp:
        try:
            serve = servers.start_serve(pathlib.Path(tmp), "--policy", "chunked", *extra)
        except servers.ServerError as exc:
            raise SystemExit(str(exc)) from None
        try:
            yield (f"http://127.0.0.1:{serve.http_port}/v1",
                   servers.children_by_role(serve.proc.pid))
        finally:
            serve.stop()


def _row(streams: int, ours: dict, theirs: dict) -> dict:
    ratio = ours["output_throughput"] / theirs["output_throughput"]
    ttft_lower = (ours["ttft_median_ms"] < theirs["ttft_median_ms"]
                  and ours["ttft_p99_ms"] < theirs["ttft_p99_ms"])
    errors = ours["num_requests"] - ours["num_completed"]
    return {"streams": streams, "theirs": theirs, "ours": ours, "ratio": ratio,
            "target": TARGET_RATIO.get(streams),
            "met": (ratio >= TARGET_RATIO.get(streams, 0.0)) and ttft_lower and not errors}


def render(rows: list[dict]) -> str:
    lines = ["| streams | llama-server tok/s | ours tok/s | ratio (target) "
             "| TTFT p50 theirs / ours s | TTFT p99 theirs / ours s | met |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        t, o = r["theirs"], r["ours"]
        target = f"{r['target']:g}x" if r["target"] is not None else "-"
        lines.append(
            f"| {r['streams']} | {t['output_throughput']:.0f} | {o['output_throughput']:.0f} "
            f"| {r['ratio']:.2f}x ({target}) "
            f"| {t['ttft_median_ms'] / 1e3:.2f} / {o['ttft_median_ms'] / 1e3:.2f} "
            f"| {t['ttft_p99_ms'] / 1e3:.2f} / {o['ttft_p99_ms'] / 1e3:.2f} "
            f"| {'yes' if r['met'] else '**no**'} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_llama_server",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-url", required=True, help="llama-server's base URL, .../v1")
    p.add_argument("--ours-url", default=None, help="a running Continuum's base URL, .../v1 "
                   "(default: start `continuum serve` here with make run's defaults)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra `continuum serve` argument (repeatable)")
    p.add_argument("--streams", default="1,8,32,64", help="concurrencies, comma separated")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-stream", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=pathlib.Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        raise SystemExit(f"--streams {args.streams!r}: comma-separated integers") from None
    rows = []
    with _ours(args.ours_url, args.serve_arg) as (ours_url, pids):
        for i, n in enumerate(streams):
            order = [("ours", ours_url), ("theirs", args.llama_url)]
            results, cores = {}, {}
            for name, url in (order if i % 2 == 0 else order[::-1]):
                before, started = servers.cpu_seconds(pids or {}), time.monotonic()
                results[name] = _point(url, n, args)
                if name == "ours" and pids:  # which of our processes the run kept busy
                    used = servers.cpu_seconds(pids)
                    used.subtract(before)
                    cores = {role: round(s / (time.monotonic() - started), 2)
                             for role, s in sorted(used.items())}
            rows.append({**_row(n, results["ours"], results["theirs"]), "ours_cores": cores})
            print(f"{n} streams: ours {results['ours']['output_throughput']:.0f} tok/s, "
                  f"llama-server {results['theirs']['output_throughput']:.0f}"
                  + (f"; our CPU use in cores {cores}" if cores else ""), flush=True)
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""End-to-end streaming throughput of a running server, at fixed concurrency.

For each concurrency C, C clients send one request after another (greedy,
ignore_eos, fixed prompt and output lengths) until C × R requests are done; prints
output tokens/s, TTFT p50/p99 and TPOT p50 (``sim.metrics`` definitions: TPOT =
(E2E − TTFT) ÷ (output tokens − 1)).

A thin entry point over ``continuum bench`` (one load generator): each row is
``continuum bench --max-concurrency C --num-prompts C×R --input-len L --output-len M``
with a fresh seed per row, so no row reuses another's prompts from the prefix cache.
Failed requests are counted on stderr and make the exit status 1.

    .venv/bin/continuum serve &       # in another terminal
    .venv/bin/python -m benchmarks.bench_serve --concurrency 1 8 16 --max-tokens 64
    .venv/bin/python -m benchmarks.bench_serve --api openai   # the same over HTTP/SSE
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from continuum.bench.run import add_arguments, run_point, validate_args
from continuum.bench.workload import BenchError


def parse_bench(*flags: str) -> argparse.Namespace:
    """``continuum bench``'s arguments from ``flags``, validated as it validates them."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*flags, "--no-progress"])
    validate_args(args)
    return args


def bench_args(api: str, addr: str, base_url: str, concurrency: int, rounds: int,
               max_tokens: int, input_len: int, seed: int) -> argparse.Namespace:
    """The ``continuum bench`` flags of one row: a closed loop of ``concurrency`` clients."""
    return parse_bench(
        "--api", api, "--addr", addr, "--base-url", base_url,
        "--num-prompts", str(concurrency * rounds), "--max-concurrency", str(concurrency),
        "--input-len", str(input_len), "--output-len", str(max_tokens), "--seed", str(seed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", default="127.0.0.1:50051", help="gRPC address")
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="OpenAI API base URL (with --api openai)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--input-len", type=int, default=40, help="prompt tokens per request")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for flag in ("concurrency", "rounds", "max_tokens", "input_len"):
        values = getattr(a, flag)
        if min(values if isinstance(values, list) else [values]) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    print(f"{'clients':>7} {'output tok/s':>12} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'TPOT p50 ms':>11}")
    failed = False  # a row with failed requests: its figures cover the rest only
    try:
        for row, c in enumerate(a.concurrency):
            args = bench_args(a.api, a.addr, a.base_url, c, a.rounds, a.max_tokens,
                              a.input_len, a.seed + row)
            report, _ = asyncio.run(run_point(args, math.inf))
            s = report["overall"]
            print(f"{c:>7} {s['output_throughput']:>12.1f} {s['ttft_median_ms']:>11.0f} "
                  f"{s['ttft_p99_ms']:>11.0f} {s['tpot_median_ms']:>11.0f}", flush=True)
            if s["errors"]:
                failed = True
                print("errors: " + ", ".join(f"{k} × {v}" for k, v in sorted(s["errors"].items())),
                      file=sys.stderr)
    except BenchError as exc:
        print(f"bench_serve: {exc}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end cost of telemetry: `continuum bench` against `continuum serve` with the
store off and on, alternately in one run (the store must cost no more than
the run-to-run noise).

Each round starts a fresh server (telemetry off, then on to a SQLite file in a temp
dir), runs the same closed-loop workload (``--concurrency`` clients, ``--num-prompts``
fixed-length requests) and records output tokens/s and TPOT p50; the on/off ratios
are printed per round and as medians.

    .venv/bin/python -m benchmarks.bench_telemetry_overhead [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import tempfile

from continuum.bench.run import add_arguments, run_point
from harness import servers


def _point(addr: str, args: argparse.Namespace) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    bench = parser.parse_args(["--addr", addr, "--num-prompts", str(args.num_prompts),
                               "--max-concurrency", str(args.concurrency), "--input-len",
                               "64", "--output-len", "32", "--no-progress"])
    report, _ = asyncio.run(run_point(bench, float("inf"), 0))
    return report["overall"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_telemetry_overhead")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args(argv)
    ratios_tput, ratios_tpot = [], []
    for r in range(args.rounds):
        results = {}
        for mode in ("off", "on"):
            tmp = pathlib.Path(tempfile.mkdtemp())
            dsn = "off" if mode == "off" else str(tmp / "telemetry.sqlite")
            serve = servers.start_serve(tmp, "--telemetry-dsn", dsn)
            try:
                results[mode] = _point(serve.addr, args)
            finally:
                serve.stop()
        off, on = results["off"], results["on"]
        ratios_tput.append(on["output_throughput"] / off["output_throughput"])
        ratios_tpot.append(on["tpot_median_ms"] / off["tpot_median_ms"])
        print(f"round {r + 1}: out tok/s off {off['output_throughput']:.1f} on "
              f"{on['output_throughput']:.1f} (x{ratios_tput[-1]:.3f}); TPOT p50 off "
              f"{off['tpot_median_ms']:.1f} on {on['tpot_median_ms']:.1f} ms "
              f"(x{ratios_tpot[-1]:.3f})", flush=True)
    print(f"median on/off: throughput x{statistics.median(ratios_tput):.3f}, "
          f"TPOT p50 x{statistics.median(ratios_tpot):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

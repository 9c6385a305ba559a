"""``continuum bench``: a load generator for a running server, over gRPC or the OpenAI API.

Requests are built from token ids (exact prompt lengths, no tokenizer needed on the
client: ids are drawn from 1000..19999, valid for any Llama-family vocabulary), greedy
with ``ignore_eos`` so every request produces exactly its output length unless cancelled.

Arrivals: Poisson at ``--request-rate`` (``--burstiness`` B ≠ 1 draws gamma gaps with
shape 1/B: bursty above 1), all at once (``inf``), capped by ``--max-concurrency``; or
replayed from a trace's arrival times (``--dataset replay``). Workloads: fixed lengths;
lengths sampled from the Azure conversation trace (``--dataset azure``) scaled by
``--length-scale`` (the report says so); long-prompt bursts (``--long-prompt-fraction``);
a shared system prompt (``--shared-prefix-len``); a fraction cancelled mid-stream
(``--cancel-fraction``); several tenants and tiers (``--tenants a:3,b:1 --tiers 0:1,1:4``).

Metrics use ``vllm bench serve``'s definitions (see ``sim/metrics.py``): TTFT, TPOT =
(E2E − TTFT) ÷ (output tokens − 1), ITL between streamed chunks, E2E; mean, median, p90,
p99; request and token throughput; goodput under ``--goodput ttft:MS tpot:MS`` — overall
and per tier and tenant. ``--output`` writes JSON; ``--sweep-rates`` runs several rates
and ``--plot`` draws latency percentiles against offered load.

This module is the command (flags, checks, the sweep); the requests are built in
``bench.workload``, sent by ``bench.clients`` and summarized by ``bench.report``.
The trace is read by ``sim.data.read_trace``; its default path follows
``$CONTINUUM_DATA_DIR`` like every other tool's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pathlib
import sys
from collections.abc import Sequence

from continuum.bench.report import format_report, plot_sweep, summarize_outcomes
from continuum.bench.workload import BenchError, build_workload
from protos import tiers


def _parse_slos(items: Sequence[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise BenchError(f"--goodput {item!r}: use ttft:MS, tpot:MS or e2e:MS")
        try:
            slos[name] = float(value)
        except ValueError as exc:
            raise BenchError(f"--goodput {item!r}: {value!r} is not a number of ms") from exc
    return slos


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc")
    p.add_argument("--addr", default="127.0.0.1:50051", help="gateway gRPC HOST:PORT")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI API base URL")
    p.add_argument("--api-key", default=None, help="API key, when the server requires one")
    p.add_argument("--dataset", choices=("fixed", "azure", "replay"), default="fixed")
    p.add_argument("--trace", type=pathlib.Path, default=None,
                   help="Azure-style CSV (arrived_at, num_prefill_tokens, num_decode_tokens); "
                        "default: traces/azure_conv_2023.csv under $CONTINUUM_DATA_DIR, "
                        "else ../shared/data")
    p.add_argument("--length-scale", type=float, default=0.25,
                   help="multiply trace lengths by this (scale to the machine; reported)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="replay: multiply trace inter-arrival times by this")
    p.add_argument("--max-input-len", type=int, default=2048)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--input-len", type=int, default=128, help="fixed dataset prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="fixed dataset output tokens")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma arrivals: 1 = Poisson, >1 burstier, <1 smoother")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (fixed-concurrency load)")
    p.add_argument("--long-prompt-fraction", type=float, default=0.0)
    p.add_argument("--long-prompt-len", type=int, default=1024)
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens of system prompt every request shares")
    p.add_argument("--cancel-fraction", type=float, default=0.0,
                   help="share of requests cancelled mid-stream")
    p.add_argument("--tenants", default="default:1", help="NAME:WEIGHT,...")
    p.add_argument("--tiers", default="1:1", help=f"TIER:WEIGHT,... (tiers {tiers.describe()})")
    p.add_argument("--goodput", nargs="*", default=[], metavar="SLO",
                   help="SLOs for goodput, e.g. ttft:500 tpot:150 (ms)")
    p.add_argument("--dollars-per-hour", type=float, default=None, metavar="USD",
                   help="what the serving hardware costs per hour: also report the cost "
                        "per 1M output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-rates", default=None,
                   help="comma-separated request rates to run one after another")
    p.add_argument("--output", type=pathlib.Path, default=None, help="write results as JSON")
    p.add_argument("--plot", type=pathlib.Path, default=None,
                   help="with --sweep-rates: PNG of latency percentiles vs load")
    p.add_argument("--no-progress", action="store_true")


def validate_args(args: argparse.Namespace) -> None:
    problems = []
    if args.num_prompts < 1:
        problems.append("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        problems.append("--request-rate must be > 0 (inf for all at once)")
    if not args.burstiness > 0:
        problems.append("--burstiness must be > 0")
    for flag in ("long_prompt_fraction", "cancel_fraction"):
        if not 0 <= getattr(args, flag) <= 1:
            problems.append(f"--{flag.replace('_', '-')} must be in [0, 1]")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        problems.append("--max-concurrency must be >= 1")
    if min(args.input_len, args.output_len, args.long_prompt_len) < 1:
        problems.append("lengths must be >= 1")
    if args.shared_prefix_len < 0:
        problems.append("--shared-prefix-len must be >= 0")
    if args.dollars_per_hour is not None and not 0 < args.dollars_per_hour < float("inf"):
        problems.append("--dollars-per-hour must be a price > 0")
    if args.plot and not args.sweep_rates:
        problems.append("--plot needs --sweep-rates")
    if problems:
        raise BenchError("; ".join(problems))


def _rates(args: argparse.Namespace) -> list[float]:
    if not args.sweep_rates:
        return [args.request_rate]
    try:
        rates = [float(r) for r in args.sweep_rates.split(",")]
    except ValueError as exc:
        raise BenchError(f"--sweep-rates {args.sweep_rates!r}: {exc}") from exc
    if any(not r > 0 for r in rates):
        raise BenchError("--sweep-rates: every rate must be > 0")
    return rates


async def run_point(args: argparse.Namespace, rate: float, point: int = 0) -> tuple[dict, str]:
    """One load point at ``rate``: build the requests, send them, summarize; returns the
    report (``bench.report.summarize_outcomes`` plus its ``config``) and its title.

    ``point`` offsets the seed: each point of a sweep gets fresh prompts, since the
    same ids would hit the prefix cache. ``args`` must have passed ``validate_args``.
    """
    slos = _parse_slos(args.goodput)
    specs = build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + point}),
                           rate)
    # grpc and aiohttp load here, not when the CLI parses its flags
    from continuum.bench.clients import GrpcClient, OpenAIClient, run_workload

    client = (OpenAIClient(args.base_url, args.api_key) if args.api == "openai"
              else GrpcClient(args.addr, args.api_key))
    try:
        outcomes, duration = await run_workload(client, specs, args.max_concurrency,
                                                progress=not args.no_progress)
    finally:
        await client.close()
    report = summarize_outcomes(outcomes, duration, slos, args.dollars_per_hour)
    report["config"] = {
        "api": args.api, "dataset": args.dataset, "request_rate": rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "num_prompts": args.num_prompts, "length_scale": args.length_scale,
        "mean_prompt_tokens": sum(len(s.prompt_ids) for s in specs) / len(specs),
        "mean_output_tokens": sum(s.max_tokens for s in specs) / len(specs),
        "slos_ms": slos,
    }
    title = (f"rate {rate:g} req/s, {args.num_prompts} requests over {args.api} "
             f"({args.dataset}, mean prompt {report['config']['mean_prompt_tokens']:.0f} / "
             f"output {report['config']['mean_output_tokens']:.0f} tokens"
             + (f", trace lengths × {args.length_scale:g}" if args.dataset != "fixed" else "")
             + f"), {duration:.1f} s")
    return report, title


async def bench(args: argparse.Namespace) -> list[tuple[float, dict]]:
    """Every rate of the sweep (or the one ``--request-rate``), one after another."""
    points = []
    for point, rate in enumerate(_rates(args)):
        report, title = await run_point(args, rate, point)
        print(format_report(report, title), flush=True)
        points.append((rate, report))
    return points


def main(args: argparse.Namespace) -> int:
    try:
        validate_args(args)
        points = asyncio.run(bench(args))
    except BenchError as exc:
        print(f"continuum bench: {exc}", file=sys.stderr)
        return 2
    if args.output:
        args.output.write_text(json.dumps([r for _, r in points], indent=2))
        print(f"results: {args.output}")
    if args.plot:
        plot_sweep(points, args.plot)
        print(f"plot: {args.plot}")
    return 0

"""Static vs continuous vs continuous + chunked prefill on the real engine, one workload.

Each policy gets a fresh ``continuum serve --policy P`` and the same requests through
``continuum bench``'s client (Azure lengths x 0.15 plus 15 % 768-token prompts, Poisson
0.8 req/s); prints requests done, output tokens/s, TTFT and TPOT p50/p99, the share of
decode steps a prefill stalled (Stats), and ratios against static; ``--output`` writes
JSON. No queue-time bound by default, so every policy serves every request.

    make bench-policies          # or: .venv/bin/python -m benchmarks.bench_policies --help
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import time

from continuum.bench.clients import GrpcClient, run_workload
from continuum.bench.report import summarize_outcomes as summarize
from continuum.bench.run import add_arguments
from continuum.bench.workload import build_workload
from harness import servers
from protos import tiers
from scheduler_svc.core import policy as registry

# The core's registry; a policy that uses TPOT targets (chunked-slo) gets --tpot-target-ms
# for every tier.
POLICIES = tuple(registry.POLICIES)


def engine_args(policy: str, args: argparse.Namespace) -> list[str]:
    """``continuum serve``'s engine flags for ``policy`` (its name is passed apart)."""
    engine = ["--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--chunk-size", str(args.chunk_size), "--kv-cache-bytes", str(args.kv_cache_bytes)]
    for tier in map(tiers.flag_word, range(tiers.NUM_TIERS)):  # one bound for all tiers
        engine += [f"--max-queue-time-{tier}-s", str(args.queue_time_bound_s)]
        if registry.POLICIES[policy].uses_tpot_targets:
            engine += [f"--tpot-target-{tier}-ms", str(args.tpot_target_ms)]
    return engine


def run_policy(policy: str, args: argparse.Namespace, workdir: pathlib.Path) -> dict:
    server = servers.start_serve(workdir / policy, "--policy", policy,
                                 *engine_args(policy, args), http=False)
    try:
        before = server.stats()
        specs = build_workload(args, args.request_rate)
        async def go():
            client = GrpcClient(f"127.0.0.1:{server.port}", None)  # on this event loop
            try:
                return await run_workload(client, specs, args.max_concurrency,
                                          progress=not args.no_progress)
            finally:
                await client.close()

        outcomes, duration = asyncio.run(go())
        after = server.stats()
    finally:
        server.stop(grace_s=60)
    report = summarize(outcomes, duration, {})["overall"]
    decode_steps = after.num_decode_steps - before.num_decode_steps
    stalled = after.num_stalled_decode_steps - before.num_stalled_decode_steps
    report["decode_steps"] = decode_steps
    report["stalled_share"] = stalled / decode_steps if decode_steps else float("nan")
    report["stalled_prefill_tokens_mean"] = (
        (after.num_stalled_prefill_tokens - before.num_stalled_prefill_tokens) / stalled
        if stalled else 0.0)
    report["steps"] = after.num_steps - before.num_steps
    report["preemptions"] = after.num_preemptions - before.num_preemptions
    return report


def format_table(results: dict[str, dict]) -> str:
    base = results.get("static")
    lines = [f"{'policy':<11}{'done':>7}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p99':>9}{'stalled':>9}{'stall tok':>10}"
             f"{'tok/s ×':>8}{'TTFT p99 ×':>11}   (ms; × = vs static)"]
    for policy, r in results.items():
        speed = r["output_throughput"] / base["output_throughput"] if base else float("nan")
        tail = r["ttft_p99_ms"] / base["ttft_p99_ms"] if base else float("nan")
        done = f"{r['num_completed']}/{r['num_requests']}"
        lines.append(
            f"{policy:<11}{done:>7}{r['output_throughput']:>10.1f}{r['ttft_median_ms']:>10.0f}"
            f"{r['ttft_p99_ms']:>10.0f}{r['tpot_median_ms']:>10.0f}{r['tpot_p99_ms']:>10.0f}"
            f"{r['itl_p99_ms']:>9.0f}{r['stalled_share']:>9.0%}{r['stalled_prefill_tokens_mean']:>10.0f}"
            f"{speed:>8.2f}{tail:>11.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(dataset="azure", length_scale=0.15, num_prompts=40, request_rate=0.8,
                        long_prompt_fraction=0.15, long_prompt_len=768, max_output_len=96,
                        max_input_len=1024)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    parser.add_argument("--tpot-target-ms", type=float, default=60.0,
                        help="chunked-slo's TPOT target, every tier")
    parser.add_argument("--queue-time-bound-s", type=float, default=0.0,
                        help="the server's max queue time, every tier (default 0: no bound, "
                        "so every policy serves every request; with a bound, a policy "
                        "compared on throughput may have refused other requests than "
                        "another: see the done column)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-policies-") as workdir:
        for policy in args.policies.split(","):
            started = time.monotonic()
            results[policy] = run_policy(policy, args, pathlib.Path(workdir))
            print(f"{policy}: done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    specs = build_workload(args, args.request_rate)
    print(f"{len(specs)} requests, Poisson {args.request_rate:g} req/s, Azure conversation "
          f"lengths × {args.length_scale:g} + {args.long_prompt_fraction:.0%} prompts of "
          f"{args.long_prompt_len} tokens (mean prompt "
          f"{sum(len(s.prompt_ids) for s in specs) / len(specs):.0f}, mean output "
          f"{sum(s.max_tokens for s in specs) / len(specs):.0f}); max_num_seqs "
          f"{args.max_num_seqs}, budget {args.max_num_batched_tokens} tokens, chunk "
          f"{args.chunk_size}")
    print(format_table(results))
    refused = {p: r["num_requests"] - r["num_completed"] for p, r in results.items()}
    if any(refused.values()):
        print("not every request completed (" + ", ".join(
            f"{p} {n}" for p, n in refused.items() if n) + "): the policies' throughputs "
            "count different requests", file=sys.stderr)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
        print(f"results: {args.output}")


if __name__ == "__main__":
    main()

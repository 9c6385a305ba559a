"""``python -m sim``: policy table, load sweep, validation, three-class overload.

Examples (docs/simulator.md holds the outputs):

    python -m sim --validate
    python -m sim --policy all --duration-s 3600
    python -m sim --sweep --rate-scales 0.1,0.2,0.3,0.4,0.5,0.75,1 --duration-s 600
    python -m sim --classes --rate-scale 0.3 --background-rate 3 --duration-s 600
    python -m sim --profile profiles/HOST.json --validate-against-server
    python -m sim --profile profiles/HOST.json --policy chunked --shared-prefixes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from scheduler_svc.core import SchedulerConfig
from sim import report
from sim.cost_model import StepCostModel
from sim.data import TraceError, data_dir, default_trace
from sim.prefix_trace import with_prefixes
from sim.profile import ExecutorProfile
from sim.workload import load_trace


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="all", choices=(*report.POLICIES, "all"))
    p.add_argument("--trace", type=Path, default=None,
                   help="CSV arrived_at,num_prefill_tokens,num_decode_tokens "
                        "(default: the Azure conversation trace)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the trace's arrival rate (same length mix)")
    p.add_argument("--duration-s", type=float, default=3600.0,
                   help="replay the arrivals of the first seconds (after scaling); "
                        "the run then drains")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--chunked-budget", type=int, default=512,
                   help="max_num_batched_tokens of the chunked policy (decodes included)")
    p.add_argument("--validate", action="store_true",
                   help="the cost model against published points")
    p.add_argument("--sweep", action="store_true", help="throughput and p99 TTFT vs load")
    p.add_argument("--rate-scales", default="0.1,0.2,0.3,0.4,0.5,0.75,1.0",
                   help="comma-separated rate scales for --sweep")
    p.add_argument("--plot", type=Path, default=None, help="--sweep: write a PNG here")
    p.add_argument("--classes", action="store_true",
                   help="three priority classes; background absorbs the overload")
    p.add_argument("--background-rate", type=float, default=3.0,
                   help="--classes: background requests/s")
    p.add_argument("--queue-cap-per-tenant", type=int, default=16,
                   help="--classes: waiting requests per class before QueueFull")
    p.add_argument("--aging-s", type=float, default=60.0,
                   help="--classes: seconds of waiting that lift a request one tier")
    p.add_argument("--contract", action="store_true",
                   help="print the service curves a capacity contract declares "
                        "(docs/capacity/contract.toml), from this cost model")
    p.add_argument("--profile", type=Path, default=None,
                   help="a fitted executor profile (python -m benchmarks.fit_profile) instead of "
                        "the 70B / 4xA100 cost model")
    p.add_argument("--validate-against-server", action="store_true",
                   help="replay one workload through a real `continuum serve` and through "
                        "the simulator with --profile; print the errors")
    p.add_argument("--quick", action="store_true",
                   help="--validate-against-server: a few tiny requests per rate (CI)")
    p.add_argument("--rates", default=None,
                   help="--validate-against-server: requests/s, comma-separated (default: "
                        "0.4, 0.7, 1.0 of the profile's predicted saturation)")
    p.add_argument("--shared-prefixes", action="store_true",
                   help="give the trace shared system prompts and multi-turn continuations "
                        "(sim/prefix_trace.py), so the prefix cache has something to hit")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--dollars-per-hour", type=float, default=report.DOLLARS_PER_HOUR,
                   help="the simulated hardware's price, for the $/1M out column "
                        f"(default: ${report.DOLLARS_PER_HOUR}/h for a 4xA100 spot node; "
                        f"its target is under ${report.COST_TARGET} per 1M output tokens)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cost = ExecutorProfile.load(args.profile) if args.profile else StepCostModel()
    except ValueError as exc:
        print(f"python -m sim: --profile {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:  # the operator profiles it is built from
        print(f"python -m sim: {exc.filename}: no such file (the data directory is "
              f"{data_dir()}; set CONTINUUM_DATA_DIR to the one holding profiles/ and "
              "traces/)", file=sys.stderr)
        return 2
    try:
        return _run(args, cost)
    except TraceError as exc:
        print(f"python -m sim: --trace {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, cost: StepCostModel) -> int:
    if not 0 < args.dollars_per_hour < float("inf"):
        print("python -m sim: --dollars-per-hour must be a price > 0", file=sys.stderr)
        return 2
    report.DOLLARS_PER_HOUR = args.dollars_per_hour
    trace = args.trace or default_trace()
    policies = report.POLICIES if args.policy == "all" else (args.policy,)
    started = time.perf_counter()
    if args.validate_against_server:
        return _validate_against_server(args)
    a100_only = [f for f in ("contract", "validate", "classes") if getattr(args, f)]
    if args.profile and a100_only:
        print(f"python -m sim: --{a100_only[0]} is for the 70B / 4xA100 cost model, "
              "not --profile", file=sys.stderr)
        return 2
    if args.contract:
        print(_contract(cost, args.max_num_seqs))
        return 0
    if args.validate:
        rows = report.validation_rows(cost)
    elif args.sweep:
        rows = _sweep(args, trace, cost, policies)
    elif args.classes:
        rows = _classes(args, trace, cost)
    else:
        reqs = load_trace(trace, args.rate_scale, args.duration_s)
        if args.shared_prefixes:
            reqs, stats = with_prefixes(reqs)
            print(stats.line())
        roofline = ("" if args.profile else f"; roofline for this mix at {args.max_num_seqs} "
                    f"sequences: {report.mix_roofline(reqs, cost, args.max_num_seqs):,.0f} "
                    "output tokens/s")
        print(f"{len(reqs)} requests over {args.duration_s:g} s at {args.rate_scale:g}× the "
              f"trace's rate{roofline}")
        rows = report.policy_table(reqs, cost, args.max_num_seqs, policies,
                                   chunked_budget=args.chunked_budget)
    print(report.table(rows))
    print(f"(simulated in {time.perf_counter() - started:.1f} s wall)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _validate_against_server(args: argparse.Namespace) -> int:
    """Runs benchmarks/sim_validate.py as a process: it needs the load generator and the
    wire, which sim/ does not import (docs/architecture.md)."""
    if args.profile is None:
        print("python -m sim: --validate-against-server needs --profile FILE (make one "
              "with `python -m benchmarks.fit_profile`)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "benchmarks.sim_validate", "--profile", str(args.profile)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--rates", args.rates] if args.rates else []
    cmd += ["--json", str(args.json)] if args.json else []
    return subprocess.run(cmd, check=False).returncode


def _contract(cost: StepCostModel, max_num_seqs: int) -> str:
    hw = cost.hw
    chunk = 512
    table = ", ".join(f"[{b}, {cost.decode_step_time(b, 0) * 1e3:.1f}]"
                      for b in (1, 8, 32, 64, max_num_seqs))
    return "\n".join([
        f"max_num_seqs = {max_num_seqs}",
        f"kv_bytes_per_token = {cost.model.kv_bytes_per_token}",
        f"kv_memory_bytes = {hw.tp * cost.kv_pool_bytes_per_gpu}",
        "[model]",
        'name = "service-curve"',
        f"prefill_tokens_per_s = {chunk / cost.prefill_time(chunk):.0f}"
        f"  # a {chunk}-token chunk alone",
        f"decode_step_ms = [{table}]  # at zero context",
        f"kv_read_bytes_per_s = {hw.tp * hw.hbm_bytes_per_s * hw.decode_attn_bw_efficiency:.4g}",
    ])


def _sweep(args, trace: Path, cost: StepCostModel, policies) -> list[dict]:
    rows = []
    for scale in (float(s) for s in args.rate_scales.split(",")):
        reqs = load_trace(trace, scale, args.duration_s)
        offered = len(reqs) / args.duration_s
        rows += report.policy_table(reqs, cost, args.max_num_seqs, policies,
                                    chunked_budget=args.chunked_budget,
                                    **{"rate ×": scale, "req/s": offered})
    if args.plot:
        _plot(rows, args.plot)
    return rows


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = [r for r in rows if r["policy"] == policy]
        ax1.plot([r["req/s"] for r in pts], [r["output tok/s"] for r in pts], "o-",
                 label=policy)
        ax2.plot([r["req/s"] for r in pts], [r["TTFT p99 ms"] / 1e3 for r in pts], "o-",
                 label=policy)
    ax1.set(xlabel="offered load (requests/s)", ylabel="output tokens/s",
            title="throughput (simulated)")
    ax2.set(xlabel="offered load (requests/s)", ylabel="p99 TTFT (s)", yscale="log",
            title="p99 TTFT (simulated)")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _classes(args, trace: Path, cost: StepCostModel) -> list[dict]:
    base = load_trace(trace, args.rate_scale, args.duration_s)
    fore, mixed = report.three_classes(base, args.background_rate, args.duration_s)
    caps = dict(max_num_waiting_per_tenant=args.queue_cap_per_tenant, aging_s=args.aging_s)
    n = args.max_num_seqs
    rows = report.class_rows(report.run(fore, "chunked", cost, n, **caps), "no background")
    rows += report.class_rows(report.run(mixed, "chunked", cost, n, **caps),
                              "+ background, tiers 0/1/2")
    flat = [dataclasses.replace(r, priority_tier=1) for r in mixed]
    rows += report.class_rows(report.run(flat, "chunked", cost, n, **caps),
                              "+ background, all tier 1")
    default_aging = SchedulerConfig.aging_s
    if args.aging_s != default_aging:
        caps["aging_s"] = default_aging
        rows += report.class_rows(report.run(mixed, "chunked", cost, n, **caps),
                                  f"+ background, tiers 0/1/2, aging {default_aging:g} s")
    return rows


if __name__ == "__main__":
    sys.exit(main())

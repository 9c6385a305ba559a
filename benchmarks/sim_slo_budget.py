"""``python -m benchmarks.sim_slo_budget``: the SLO-aware token budget in the simulator at
70B: every registered policy (static, continuous, chunked, chunked-slo, ...) on one trace.

Each policy is ``sim.engine.policy_config``'s (chunked-slo: chunked with every tier's
TPOT target ``SLO_TPOT_TARGET_MS`` under a ``SLO_BUDGET``-token ceiling, the online
step-time fit of ``scheduler_svc/core/step_cost.py`` fed each simulated step), run on
the 70B / 4xA100 cost model with token times recorded, so the table has the inter-token
latency (ITL p99: the worst stall a decode sees) next to throughput, TTFT and TPOT.

    .venv/bin/python -m benchmarks.sim_slo_budget --rate-scale 0.4 --duration-s 600
"""

from __future__ import annotations

import argparse
import sys

from scheduler_svc.core.policy import POLICIES
from sim import engine, report
from sim.cost_model import StepCostModel
from sim.data import default_trace
from sim.engine import Simulation, policy_config
from sim.metrics import summarize
from sim.workload import load_trace


def rows(rate_scale: float, duration_s: float, target_ms: float, max_num_seqs: int = 128,
         policies=report.POLICIES) -> list[dict]:
    engine.SLO_TPOT_TARGET_MS = target_ms
    reqs = load_trace(default_trace(), rate_scale, duration_s)
    cost = StepCostModel()
    out = []
    for p in policies:
        res = Simulation(reqs, policy_config(p, max_num_seqs), cost,
                         record_token_times=True).run()
        s = summarize([r.timing() for r in res.finished], duration_s=res.end_s or None)
        label = f"{p} ({target_ms:g} ms)" if POLICIES[p].uses_tpot_targets else p
        out.append({"policy": label,
                    "finished": len(res.finished),
                    "output tok/s": res.num_output_tokens / res.end_s if res.end_s else 0.0,
                    "TTFT p50 ms": s["ttft_median_ms"], "TTFT p99 ms": s["ttft_p99_ms"],
                    "TPOT p99 ms": s["tpot_p99_ms"], "ITL p99 ms": s["itl_p99_ms"],
                    "preemptions": res.num_preemptions, "wall s": res.wall_s})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_slo_budget",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rate-scale", type=float, default=0.4)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--tpot-target-ms", type=float, default=engine.SLO_TPOT_TARGET_MS)
    p.add_argument("--policies", default=",".join(report.POLICIES))
    args = p.parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in policies if x not in report.POLICIES]
    if bad or not args.rate_scale > 0 or not args.duration_s > 0 or not args.tpot_target_ms > 0:
        p.error(f"policies are {', '.join(report.POLICIES)}; rate, duration and target > 0")
    got = rows(args.rate_scale, args.duration_s, args.tpot_target_ms, policies=policies)
    print(f"70B / 4xA100 cost model, Azure conversation trace × {args.rate_scale:g}, "
          f"{args.duration_s:g} s of arrivals")
    print(report.table(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())

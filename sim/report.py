"""Experiments the simulator reports, as rows of plain dicts, and their tables.

Each function runs the real scheduler core through ``Simulation`` and returns
rows; ``table`` prints any rows as a Markdown table.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.core import policy
from sim.cost_model import StepCostModel
from sim.engine import SimResult, Simulation, policy_config
from sim.metrics import cost_per_million, summarize
from sim.workload import TraceRequest, merge, poisson_class, split_classes

POLICIES = tuple(policy.POLICIES)  # the core's registry, in its order
# The price of the simulated hardware (a 4xA100 80GB spot node), and the cost target:
# under $0.50 per 1M output tokens. `python -m sim --dollars-per-hour` changes the price.
DOLLARS_PER_HOUR = 8.20
COST_TARGET = 0.50


def run(requests: Sequence[TraceRequest], policy: str, cost: StepCostModel,
        max_num_seqs: int = 128, **overrides) -> SimResult:
    return Simulation(requests, policy_config(policy, max_num_seqs, **overrides), cost).run()


def result_row(res: SimResult, **labels) -> dict:
    """One table row: throughput over the whole run, latencies of finished requests."""
    s = summarize([r.timing() for r in res.finished], duration_s=res.end_s or None)
    return {**labels,
            "requests": len(res.records),
            "rejected": len(res.rejected),
            "output tok/s": res.num_output_tokens / res.end_s if res.end_s else 0.0,
            "TTFT p50 ms": s["ttft_median_ms"], "TTFT p99 ms": s["ttft_p99_ms"],
            "TPOT p50 ms": s["tpot_median_ms"], "TPOT p99 ms": s["tpot_p99_ms"],
            "stalled decode steps %": 100 * res.num_stalled_decode_steps
            / max(1, res.num_decode_steps),
            "$/1M out": cost_per_million(res.num_output_tokens / res.end_s
                                         if res.end_s else 0.0, DOLLARS_PER_HOUR),
            "preemptions": res.num_preemptions,
            "prefix hit %": 100 * res.prefix_hit_tokens / max(1, sum(
                r.num_prompt_tokens for r in res.records)),
            "swapped in blocks": res.num_swapped_in_blocks,
            "sim s": res.end_s, "wall s": res.wall_s}


def mix_roofline(requests: Sequence[TraceRequest], cost: StepCostModel,
                 num_seqs: int = 128) -> float:
    """Output tokens/s no policy can beat on this length mix: every prompt token at
    100 % of peak FLOPs, every output token in a full batch of ``num_seqs`` decodes
    reading weights and KV at full bandwidth (mean context)."""
    m, hw = cost.model, cost.hw
    n = len(requests)
    prompt = sum(r.num_prompt_tokens for r in requests) / n
    output = sum(r.num_output_tokens for r in requests) / n
    flops_per_token = 2 * (m.num_layers * m.layer_params + m.vocab * m.hidden)
    prefill_s = prompt * flops_per_token / (hw.tp * hw.peak_flops)
    context = int(prompt + output / 2)
    decode_s = output * cost.floor_s(num_seqs * context) / num_seqs
    return output / (prefill_s + decode_s)


def policy_table(requests: Sequence[TraceRequest], cost: StepCostModel,
                 max_num_seqs: int = 128, policies: Sequence[str] = POLICIES,
                 chunked_budget: int = 512, **labels) -> list[dict]:
    rows = []
    for p in policies:
        extra = {}
        if p == "chunked" and chunked_budget != 512:
            extra = dict(max_num_batched_tokens=chunked_budget)
        rows.append(result_row(run(requests, p, cost, max_num_seqs, **extra),
                               policy=p if not extra else f"{p} ({chunked_budget})", **labels))
    return rows


def validation_rows(cost: StepCostModel) -> list[dict]:
    """The cost model against published points (docs/design.md §7, docs/facts.md "Data")."""
    # vLLM 0.6.6 latency test: batch 8, 32-token prompts, 128 output tokens, 4.946 s.
    batch = [(32, 0)] * 8
    total = cost.step_time(batch) + sum(cost.decode_step_time(8, 32 + k) for k in range(127))
    rows = [{"point": "vLLM 0.6.6 latency test, batch 8, 32 in / 128 out (s per batch)",
             "published": 4.946, "model": total, "error %": 100 * (total / 4.946 - 1)},
            {"point": "  same, per decode step (ms)", "published": 38.6,
             "model": total / 128 * 1e3, "error %": 100 * (total / 128 / 0.0386 - 1)}]
    floor = cost.floor_s(0) * 1e3
    rows.append({"point": "weights-only floor (139.0 GB ÷ 4 ÷ 2.04 TB/s, ms/step)",
                 "published": 17.0, "model": floor, "error %": 100 * (floor / 17.0 - 1)})
    lowest = min(cost.decode_step_time(b, 0) for b in (1, 2, 4, 8)) * 1e3
    rows.append({"point": "  model's fastest decode step (batch 1–8, no context; must be ≥)",
                 "published": 17.0, "model": lowest, "error %": "≥ floor" if lowest >= 17.0
                 else "BELOW FLOOR"})
    for b, c, lo, hi in ((128, 1024, 52, 61), (128, 2048, 52, 61)):
        t = cost.decode_step_time(b, c) * 1e3
        rows.append({"point": f"decode step, {b} seqs × {c} context (ms; docs/design.md §7: 52–61)",
                     "published": (lo + hi) / 2, "model": t,
                     "error %": 100 * (t / ((lo + hi) / 2) - 1)})
    t = cost.prefill_time(1024) * 1e3
    rows.append({"point": "1,024-token prefill (ms; 113 at 100 % peak, ≈ 220 in practice)",
                 "published": 220.0, "model": t, "error %": 100 * (t / 220 - 1)})
    return rows


def three_classes(base: Sequence[TraceRequest], background_rate: float, duration_s: float,
                  seed: int = 0) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """(interactive + standard, the same plus a background class): the trace's requests
    split 1:1 into interactive (tier 0) and standard (tier 1); background (tier 2) is a
    bulk summarisation class: Poisson, 2,048-token prompts, 256-token outputs (±50 %)."""
    fore = split_classes(base, [("interactive", 0, 1.0), ("standard", 1, 1.0)], seed)
    bg = poisson_class(background_rate, duration_s, 2048, 256, "background", 2, seed=seed + 1)
    return fore, merge(fore, bg)


def class_rows(res: SimResult, scenario: str) -> list[dict]:
    rows = []
    for klass in sorted({r.klass for r in res.records}, key=_class_order):
        recs = [r for r in res.records if r.klass == klass]
        fin = [r.timing() for r in recs if r.finish_s is not None]
        s = summarize(fin, duration_s=res.end_s)
        rows.append({"scenario": scenario, "class (tier)": f"{klass} ({recs[0].priority_tier})",
                     "offered": len(recs), "rejected %": 100 * sum(
                         r.rejected is not None for r in recs) / len(recs),
                     "output tok/s": sum(r.num_output_tokens for r in recs) / res.end_s,
                     "TTFT p50 ms": s["ttft_median_ms"], "TTFT p99 ms": s["ttft_p99_ms"],
                     "TPOT p50 ms": s["tpot_median_ms"], "TPOT p99 ms": s["tpot_p99_ms"]})
    return rows


def _class_order(name: str) -> int:
    order = ("interactive", "standard", "background")
    return order.index(name) if name in order else len(order)


def table(rows: Sequence[dict]) -> str:
    """Rows as a Markdown table; floats rounded for reading."""
    if not rows:
        return "(no rows)"
    cols = list(rows[0])

    def fmt(v) -> str:
        if isinstance(v, float):
            if v != v:  # NaN
                return "–"
            if abs(v) < 10:
                return f"{v:.2f}"
            return f"{v:,.1f}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)

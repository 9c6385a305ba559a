"""``continuum capacity audit CONTRACT WORKLOAD``: screen a workload against a contract
with the service model the contract names, and shed from the lowest tier up when the
mix is over a bound.

Every model is a fluid screen, not a measurement (the claim line says so): it can
reject an impossible plan; a passing plan still needs trace replay (``python -m sim``)
and a load test (``continuum bench``). docs/capacity/README.md has the models' formulas
and the report's figures.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

from continuum.capacity import partitioned, service_curve
from continuum.capacity.contract import (
    AuditError,
    Contract,
    RequestClass,
    content_id,
    load,
    read_plan,
)
from continuum.capacity.evaluation import Evaluation

CLAIM = "FLUID_CAPACITY_MODEL_NOT_A_MEASUREMENT"
WITHIN = "CAPACITY_WITHIN_DECLARED_BOUND"
SHED = "SHED_LOWEST_PRIORITY"  # over; the most important tiers fit once lower ones shed
OVER = "OVER_DECLARED_BOUND"  # over with the most important tier alone

MODELS: dict[str, Callable[[Contract, Sequence[RequestClass]], Evaluation]] = {
    "service-curve": service_curve.evaluate,
    "partitioned": partitioned.evaluate,
}


def evaluate(contract: Contract, classes: Sequence[RequestClass]) -> Evaluation:
    return MODELS[contract.model.name](contract, tuple(classes))


@dataclasses.dataclass
class Decision:
    verdict: str  # WITHIN | SHED | OVER
    offered: Evaluation
    admitted: Evaluation | None = None  # after shedding
    shed: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)
    # (class, admissible rate, offered rate)
    kept: list[str] = dataclasses.field(default_factory=list)  # classes kept in full


def decide(contract: Contract, classes: Sequence[RequestClass]) -> Decision:
    """Within bound; else the most important tiers that fit in full, the next one scaled
    to the highest rate at which every bound holds and the rest shed; else over bound."""
    offered = evaluate(contract, classes)
    if offered.ok:
        return Decision(WITHIN, offered)
    tiers = sorted({c.tier for c in classes})
    kept = 0
    while kept < len(tiers) and evaluate(
            contract, [c for c in classes if c.tier <= tiers[kept]]).ok:
        kept += 1
    if kept == 0:
        return Decision(OVER, offered)
    nxt = tiers[kept]

    def scaled(scale: float) -> list[RequestClass]:
        return [c if c.tier < nxt else dataclasses.replace(c, rate_per_s=c.rate_per_s * scale)
                for c in classes if c.tier <= nxt]

    lo, hi = 0.0, 1.0
    for _ in range(40):  # bisect the scale of the next tier's rates to 1e-12
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if evaluate(contract, scaled(mid)).ok else (lo, mid)
    admitted = scaled(lo)
    shed = [(c.name, c.rate_per_s * lo if c.tier == nxt else 0.0, c.rate_per_s)
            for c in sorted(classes, key=lambda c: c.tier) if c.tier >= nxt]
    return Decision(SHED, offered, evaluate(contract, admitted), shed,
                    [c.name for c in classes if c.tier < nxt])


def _num(x, decimals: int = 1) -> str:
    """Rounded half up, a trailing ``.0`` dropped; exact for the partitioned model."""
    if x == math.inf:
        return "inf"
    tenths = math.floor(Fraction(x) * 10 ** decimals + Fraction(1, 2))
    if not decimals:
        return str(tenths)
    return str(tenths // 10) + (f".{tenths % 10}" if tenths % 10 else "")


def render(contract: Contract, decision: Decision) -> str:
    """key=value lines a script can grep, then a table per class."""
    lines = [f"claim={CLAIM}",
             f"contract={contract.name};model={contract.model.name};"
             f"content_id={contract.content_id}"]
    lines += [f"example={contract.example}"] if contract.example else []
    lines.append(f"decision={decision.verdict}")
    if decision.offered.violated():
        lines.append(f"over_bounds={','.join(decision.offered.violated())}")
    lines += _summary(contract, decision.offered, "offered")
    for name, rate, offered in decision.shed:
        pct = 100 * (1 - rate / offered) if offered else 0.0
        lines.append(f"shed class={name};admit_rate_per_s<={float(rate):.4g} of "
                     f"{float(offered):g} (reject or degrade {pct:.0f} %)")
    if decision.admitted is not None:
        lines.append(f"kept_within_bounds={','.join(decision.kept)}")
        lines += _summary(contract, decision.admitted, "after_shedding")
    return "\n".join(lines)


def _summary(k: Contract, ev: Evaluation, label: str) -> list[str]:
    lines = [f"[{label}]",
             f"utilization_permille={_num(ev.utilization * 1000, 0)};"
             f"prefill={_num(ev.prefill_utilization * 1000, 0)};"
             f"decode={_num(ev.decode_utilization * 1000, 0)}"
             f" (bound {_num(k.max_utilization * 1000, 0)})",
             f"queue_ms={_num(ev.queue_ms)};worst_ttft_ms={_num(ev.worst_ttft_ms)};"
             f"tpot_ms={_num(ev.tpot_ms)};worst_iteration_ms={_num(ev.worst_iteration_ms)}"
             f" (slo {k.slo_queue_ms:g};{k.slo_ttft_ms:g};{k.slo_tpot_ms:g})",
             f"active_sequences={_num(ev.active)} (bound {k.max_num_seqs});"
             f"prefill_chunk_tokens={ev.chunk_tokens}",
             f"peak_kv_bytes={_num(ev.peak_kv_bytes, 0)} (bound {k.kv_memory_bytes})",
             *ev.details,
             "| class | tier | req/s | queue ms | TTFT floor ms | active | KV bytes | over |",
             "|---|---|---|---|---|---|---|---|"]
    for c in ev.classes:
        lines.append(f"| {c.name} | {c.tier} | {float(c.rate_per_s):.4g} | {_num(c.queue_ms)} | "
                     f"{_num(c.ttft_floor_ms)} | {_num(c.active)} | {_num(c.kv_bytes, 0)} | "
                     f"{','.join(c.violations) or '-'} |")
    return lines


def main(args) -> int:
    """Exit 0 within bound, 1 over bound (shed or not), 2 on input problems."""
    try:
        if args.capacity_command == "content-id":
            print(content_id(load(Path(args.contract))))
            return 0
        contract, workload = read_plan(Path(args.contract), Path(args.workload))
        extra: list[str] = []
        if args.from_profile:
            contract, extra = _from_profile(contract, workload.classes, args)
        decision = decide(contract, workload.classes)
    except AuditError as exc:
        for problem in exc.problems:
            print(f"continuum capacity: {problem}", file=sys.stderr)
        return 2
    print(render(contract, decision))
    for line in extra:
        print(line)
    return 0 if decision.verdict == WITHIN else 1


def _from_profile(contract: Contract, classes, args) -> tuple[Contract, list[str]]:
    if contract.model.name != "partitioned":
        raise AuditError([f"{args.contract}: --from-profile screens a partitioned contract "
                          "([model] name = \"partitioned\", e.g. "
                          "docs/capacity/local-contract.toml)"])
    from continuum.capacity import profile as served_profile
    from sim.profile import ExecutorProfile

    try:
        profile = ExecutorProfile.load(Path(args.from_profile))
    except ValueError as exc:
        raise AuditError([str(exc)]) from None
    measured, served = served_profile.screen(profile, contract, classes)
    return measured, served_profile.describe(profile, contract, served, measured)

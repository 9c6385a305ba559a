"""``continuum capacity audit CONTRACT WORKLOAD``: a fluid screening model.

The contract declares one replica's scheduler limits, service curves, memory and
SLOs; the workload declares request classes (rate, prompt/output lengths, priority
tier, cancellations). The audit screens the mix against the contract:

* device time per request of class c: s_c = P_c ÷ R_prefill + O_c × t(B) ÷ B, with
  t(n) the declared decode step time at batch n (plus its KV reads) and B =
  max_num_seqs: decodes in full batches, the cheapest they can be;
* utilization ρ = Σ λ_c s_c, split into prefill and decode shares;
* iteration time T = t(N) ÷ (1 − ρ_prefill) (each iteration carries its share of
  prefill), capped by a full token budget; concurrency N = Σ λ_c × (time in
  service) by Little's law, solved as a fixed point;
* queue delay per tier: non-preemptive priority M/G/1 (Cobham), exponential
  service-time spread: W_k = W₀ ÷ ((1 − σ_{k−1})(1 − σ_k)), σ_k the load of tiers ≤ k;
* TTFT floor = W + ⌈P99 ÷ prefill tokens per iteration⌉ × T; TPOT floor = T; worst
  iteration = t(N) + a full budget of prefill;
* peak KV = Σ N_c × (P99_c + O99_c) × KV bytes/token + what cancelled requests hold
  for their cancellation lag.

When the mix is over a bound, the audit sheds from the lowest priority up: it finds
the highest rate of the least important classes at which every bound still holds.
A fluid model ignores burstiness, correlation, fragmentation and preemption: it can
reject an impossible plan; a passing plan still needs trace replay (``python -m sim``)
and a load test.

Layers, each importing only the ones below: ``contract`` (input types and parsing) <-
``capacity_model`` (the arithmetic) <- this module (the command and its report).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from continuum import batching_audit, batching_contract
from continuum.capacity_model import Decision, Evaluation, decide
from continuum.contract import AuditError, Contract, Workload, load, parse_contract, parse_workload

CLAIM = "FLUID_SCREENING_MODEL_NOT_A_MEASUREMENT"


# -- the command -----------------------------------------------------------------------

def audit(contract_path: Path, workload_path: Path) -> tuple[Contract, Workload, Decision]:
    """(contract, workload, decision); raises AuditError on bad input."""
    problems = []
    contract = workload = None
    try:
        contract = parse_contract(load(contract_path), str(contract_path))
    except AuditError as exc:
        problems += exc.problems
    try:
        workload = parse_workload(load(workload_path), str(workload_path))
    except AuditError as exc:
        problems += exc.problems
    if contract and workload and workload.contract != contract.name:
        problems.append(f"{workload_path}: written for contract {workload.contract!r}, "
                        f"but {contract_path} declares {contract.name!r}")
    if problems:
        raise AuditError(problems)
    return contract, workload, decide(contract, workload.classes)


def _ms(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:,.0f}"


def render(contract: Contract, decision: Decision) -> str:
    """The audit's report: key=value lines a script can grep, then a table per class."""
    ev = decision.offered
    lines = [f"claim={CLAIM}",
             f"contract={contract.name}",
             f"decision={decision.verdict}"]
    if ev.violated():
        lines.append(f"over_bounds={','.join(ev.violated())}")
    lines += _summary(contract, ev, "offered")
    if decision.admitted is not None:
        for name, rate, offered in decision.shed:
            pct = 100 * (1 - rate / offered) if offered else 0.0
            lines.append(f"shed class={name} admit_rate_per_s<={rate:.2f} of {offered:.2f} "
                         f"(reject or degrade {pct:.0f} %)")
        lines.append(f"kept_within_bounds={','.join(decision.kept)}")
        lines += _summary(contract, decision.admitted, "after_shedding")
    return "\n".join(lines)


def _summary(contract: Contract, ev: Evaluation, label: str) -> list[str]:
    k = contract
    lines = [f"[{label}]",
             f"utilization_permille={ev.utilization * 1e3:.0f};prefill="
             f"{ev.prefill_utilization * 1e3:.0f};decode={ev.decode_utilization * 1e3:.0f}"
             f" (bound {k.max_utilization * 1e3:.0f})",
             f"active_seqs={ev.concurrency:.1f} (bound {k.max_num_seqs})",
             f"tpot_ms={ev.iteration_ms:.1f};worst_iteration_ms={ev.worst_iteration_ms:.1f}"
             f" (slo {k.slo_tpot_ms:g})",
             f"peak_kv_bytes={ev.peak_kv_bytes:.0f} (bound {k.kv_memory_bytes})",
             "| class | tier | req/s | util ‰ | queue ms | TTFT floor ms | seqs | KV GB | over |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in ev.classes:
        lines.append(f"| {c.name} | {c.priority} | {c.rate_per_s:.2f} | "
                     f"{c.utilization * 1e3:.0f} | {_ms(c.queue_ms)} | {_ms(c.ttft_floor_ms)} | "
                     f"{c.concurrency:.1f} | {c.peak_kv_bytes / 1e9:.1f} | "
                     f"{','.join(c.violations) or '-'} |")
    return lines


def main(args) -> int:
    """Exit 0 within bound, 1 over bound (shed or not), 2 on input problems. A contract
    with ``kind = "batching"`` is seed 002's (``continuum.batching_audit``)."""
    try:
        if args.capacity_command == "content-id":
            print(batching_contract.content_id(load(Path(args.contract))))
            return 0
        profile = getattr(args, "from_profile", None)
        if batching_contract.is_batching(load(Path(args.contract))):
            return _batching(Path(args.contract), Path(args.workload), profile)
        if profile:
            raise AuditError([f"{args.contract}: --from-profile screens a batching contract "
                              "(kind = \"batching\", e.g. docs/capacity/seed-contract.toml)"])
        contract, _, decision = audit(Path(args.contract), Path(args.workload))
    except AuditError as exc:
        for problem in exc.problems:
            print(f"continuum capacity: {problem}", file=sys.stderr)
        return 2
    print(render(contract, decision))
    return 0 if decision.verdict == "CAPACITY_WITHIN_DECLARED_BOUND" else 1


def _batching(contract_path: Path, workload_path: Path, profile_path: str | None) -> int:
    contract = batching_contract.parse_contract(load(contract_path), str(contract_path))
    workload = batching_contract.parse_workload(load(workload_path), str(workload_path))
    batching_contract.bind(contract, workload)
    extra: list[str] = []
    audited = contract
    if profile_path:
        from continuum import batching_profile
        from sim.profile import ExecutorProfile

        try:
            profile = ExecutorProfile.load(Path(profile_path))
        except ValueError as exc:
            raise AuditError([str(exc)]) from None
        audited, served, report = batching_profile.screen(profile, contract, workload.classes)
        extra = batching_profile.describe(profile, contract, served, audited)
    else:
        report = batching_audit.evaluate(contract, workload.classes)
    print(batching_audit.render(audited, report,
                                batching_audit.shed(audited, workload.classes)))
    for line in extra:
        print(line)
    return 0 if report.decision == batching_audit.WITHIN else 1

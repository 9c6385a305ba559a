"""``python -m benchmarks.capacity_check``: the capacity audit's verdict against the
simulator's and a real run's, at the same load.

A passing capacity audit is a fluid screen and still needs trace replay and a load test.
For a partitioned contract, each workload bound to it and this machine's fitted executor
profile, three sources judge the same load:

* **audit**: ``continuum capacity audit CONTRACT WORKLOAD --from-profile PROFILE``, called
  in-process (``continuum.capacity.profile.screen``): the fluid screen on the partitions
  the profile serves at the contract's iteration period.
* **simulator**: Poisson arrivals of every class (fixed lengths per class, the class's
  tier) through ``sim.engine.Simulation`` with the profile as its cost model.
* **real**: the same requests (token ids, lengths, arrival times) sent by ``continuum
  bench``'s client to a ``continuum serve`` started here on loopback, with its own
  internal secret (``benchmarks.sim_server.start``).

The simulator and the server run one scheduler config: the chunked policy,
``max_num_seqs`` = the contract's active-sequence bound, ``chunk_size`` = the audit's
(capped) prefill chunk, a step budget of one chunk plus a decode per sequence, the KV
pool the contract declares, serve's defaults otherwise (queue-time shedding included).

Judged on what a client sees, against the contract's SLOs: queue p50 (arrival to first
step; the server reports it in each stream's ``Timing``), TTFT p99 and TPOT p99, and no
request refused or unfinished. Utilization is printed, not judged (it is not the same
figure in each source): audit = offered token/s ÷ the served budget; simulator = the
share of simulated time a step ran; real = token/s served ÷ the profile's served budget
(the server exposes no busy time). The audit's queue is the fluid mean, its TTFT the
worst class's floor.

    .venv/bin/python -m benchmarks.capacity_check --profile profiles/HOST.json
    .venv/bin/python -m benchmarks.capacity_check --quick     # CI: seconds of arrivals

Without ``--profile`` it reads ``profiles/<hostname>.json``, fitting one first with
``python -m benchmarks.fit_profile --quick`` when there is none.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from continuum.capacity import profile as served_profile
from continuum.capacity.audit import evaluate
from continuum.capacity.contract import AuditError, Contract, Workload, read_plan
from scheduler_svc.core import SchedulerConfig
from sim.engine import BLOCK_SIZE, Simulation
from sim.metrics import percentile, summarize
from sim.profile import ExecutorProfile
from sim.workload import TraceRequest, merge, poisson_class

DOCS = Path(__file__).resolve().parent.parent / "docs" / "capacity"
CONTRACT = DOCS / "local-contract.toml"
WORKLOADS = (DOCS / "local-workload.toml", DOCS / "local-workload-over.toml")
SOURCES = ("audit", "simulator", "real")
TOKEN_IDS = (1000, 20000)  # continuum bench's range: valid for any Llama vocabulary


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    contract: Contract
    workload: Workload


def load_plan(contract_path: Path, workload_path: Path) -> Plan:
    """Raises AuditError for a file that is not a partitioned contract / bound workload."""
    k, w = read_plan(contract_path, workload_path)
    if k.model.name != "partitioned":
        raise AuditError([f"{contract_path}: capacity_check screens a partitioned contract"])
    return Plan(workload_path.stem, k, w)


def scheduler_config(k: Contract, chunk: int) -> SchedulerConfig:
    return SchedulerConfig(policy="chunked", max_num_seqs=k.max_num_seqs,
                           chunk_size=chunk, max_num_batched_tokens=chunk + k.max_num_seqs)


def arrivals(w: Workload, duration_s: float, seed: int) -> list[TraceRequest]:
    """Poisson arrivals of each class at its rate, fixed lengths, random token ids (the
    same ids go to the simulator and the server, so prefix caching sees the same). A
    class that draws no arrival in a short run gets one at ``duration_s`` ÷ 2, so every
    class is seen."""
    streams = []
    for i, c in enumerate(w.classes):
        got = poisson_class(float(c.rate_per_s), duration_s, c.prompt_tokens, c.output_tokens,
                            c.name, min(c.tier, 2), seed=seed + i, jitter=0.0)
        streams.append(got or [TraceRequest(duration_s / 2, c.prompt_tokens, c.output_tokens,
                                            c.name, min(c.tier, 2), c.name)])
    rng = random.Random(seed)
    return [dataclasses.replace(r, prompt_ids=tuple(rng.randrange(*TOKEN_IDS)
                                                    for _ in range(r.num_prompt_tokens)))
            for r in merge(*streams)]


def judge(k: Contract, row: dict) -> str:
    """WITHIN, or EXCEEDS with the bounds passed (what a client saw against the SLOs)."""
    over = [name for name, col, slo in (("queue", "queue p50 ms", k.slo_queue_ms),
                                        ("ttft", "TTFT p99 ms", k.slo_ttft_ms),
                                        ("tpot", "TPOT p99 ms", k.slo_tpot_ms))
            if not row[col] <= float(slo)]  # NaN (nothing finished) is over too
    if row["refused"] or row["completed"] < row["requests"]:
        over.append("refused" if row["refused"] else "unfinished")
    return "WITHIN" if not over else _exceeds(over)


def _exceeds(over: list[str], shown: int = 3) -> str:
    more = f" +{len(over) - shown}" if len(over) > shown else ""
    return f"EXCEEDS ({','.join(over[:shown])}{more})"


def audit_row(profile: ExecutorProfile, plan: Plan, num_requests: int) -> tuple[dict, int]:
    """(the audit's row, the prefill chunk it capped to: the declared one when not one
    step fits the iteration, so the simulator and the server still run a sane config)."""
    measured, served = served_profile.screen(profile, plan.contract, plan.workload.classes)
    r = evaluate(measured, plan.workload.classes)
    verdict = "WITHIN" if r.ok else _exceeds(r.violated())
    nothing = served.decodes == 0 and served.prefill_tokens == 0  # no step fits T
    return {"source": "audit", "utilization %": math.inf if nothing else 100 * float(r.utilization),
            "queue p50 ms": float(r.queue_ms), "TTFT p99 ms": float(r.worst_ttft_ms),
            "TPOT p99 ms": float(r.tpot_ms), "requests": num_requests, "completed": "–",
            "refused": "–", "verdict": verdict}, (r.chunk_tokens
                                                  or plan.contract.chunk_size)


class _Busy:
    """The profile, counting the simulated time steps ran (the simulator's utilization)."""

    def __init__(self, profile: ExecutorProfile) -> None:
        self.profile, self.busy_s = profile, 0.0

    def step_time(self, seqs, num_sampled=None) -> float:
        t = self.profile.step_time(seqs, num_sampled)
        self.busy_s += t
        return t

    def num_kv_blocks(self, block_size: int) -> int:
        return self.profile.num_kv_blocks(block_size)


def sim_row(profile: ExecutorProfile, config: SchedulerConfig, reqs: list[TraceRequest],
            num_blocks: int) -> dict:
    cost = _Busy(profile)
    res = Simulation(reqs, config, cost, num_blocks=num_blocks, num_host_blocks=0).run()
    fin = res.finished
    s = summarize([r.timing() for r in fin], duration_s=res.end_s or None)
    queue = [(r.first_scheduled - r.arrival_s) * 1e3 for r in fin if r.first_scheduled is not None]
    return {"source": "simulator", "utilization %": 100 * cost.busy_s / res.end_s
            if res.end_s else 0.0, "queue p50 ms": percentile(queue, 50),
            "TTFT p99 ms": s["ttft_p99_ms"], "TPOT p99 ms": s["tpot_p99_ms"],
            "requests": len(reqs), "completed": len(fin), "refused": len(res.rejected)}


async def _send(client, specs, deadline_s: float):
    """Each spec at its arrival time (``run_workload``'s loop, with a deadline: a request
    still streaming at ``deadline_s`` is cancelled and counts as unfinished)."""
    from continuum.bench.clients import Outcome

    started = time.perf_counter()
    clock = lambda: time.perf_counter() - started  # noqa: E731
    outcomes = [Outcome(s.index, s.tenant, s.tier, len(s.prompt_ids), s.max_tokens, sent_s=0.0)
                for s in specs]

    async def one(spec, outcome) -> None:
        await asyncio.sleep(max(0.0, spec.arrival_s - clock()))
        outcome.sent_s = clock()
        await client.run(spec, outcome, clock)

    tasks = [asyncio.create_task(one(s, o)) for s, o in zip(specs, outcomes, strict=True)]
    _, late = await asyncio.wait(tasks, timeout=deadline_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    return outcomes, clock()


def real_row(server, reqs: list[TraceRequest], served_per_s: float, deadline_s: float,
             log=print) -> dict:
    from continuum.bench.clients import GrpcClient
    from continuum.bench.workload import Spec

    specs = [Spec(index=i, arrival_s=r.arrival_s, prompt_ids=list(r.prompt_ids),
                  max_tokens=r.num_output_tokens, tenant=r.tenant, tier=r.priority_tier)
             for i, r in enumerate(reqs)]
    async def go():
        client = GrpcClient(server.addr, None)  # its outcomes keep the server's queue time
        try:
            return await _send(client, specs, deadline_s)
        finally:
            await client.close()

    outcomes, duration = asyncio.run(go())
    errors: dict[str, str] = {}
    for o in outcomes:
        if o.status not in ("ok", "cancelled"):
            errors.setdefault(o.code or o.status, o.detail)
    for status, detail in errors.items():  # what a refused request was told, once a code
        log(f"refused: {status}: {detail}")
    done = [o for o in outcomes if o.completed and o.first_token_s is not None]
    s = summarize([(o.sent_s, o.first_token_s, o.finish_s, o.output_tokens) for o in done])
    tokens = sum(o.prompt_tokens + o.output_tokens for o in done)
    return {"source": "real", "utilization %": 100 * tokens / duration / served_per_s
            if duration and served_per_s else float("nan"),
            "queue p50 ms": percentile([o.queue_s * 1e3 for o in done
                                        if o.queue_s is not None], 50),
            "TTFT p99 ms": s["ttft_p99_ms"], "TPOT p99 ms": s["tpot_p99_ms"],
            "requests": len(specs), "completed": len(done),
            "refused": sum(o.status not in ("ok", "cancelled") for o in outcomes)}


def check(profile: ExecutorProfile, plans: list[Plan], duration_s: float, real: bool = True,
          seed: int = 0, deadline_s: float | None = None, log=print) -> list[dict]:
    """One row per plan and source, each with its verdict. Plans share one contract's
    scheduler config, so one server serves them all, one after the other; a real run
    still streaming ``deadline_s`` after its start is cut there (its rest is unfinished)."""
    deadline_s = deadline_s or 3 * duration_s + 120
    k = plans[0].contract
    loads = [arrivals(p.workload, duration_s, seed + 100 * i) for i, p in enumerate(plans)]
    audits = [audit_row(profile, p, len(r)) for p, r in zip(plans, loads, strict=True)]
    chunk = audits[0][1]
    config = scheduler_config(k, chunk)
    num_blocks = k.kv_memory_bytes // (BLOCK_SIZE * profile.kv_bytes_per_token)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="capacity-check-") as tmp:
        server = _start(k, config, tmp, log) if real else None
        try:
            if server is not None:
                num_blocks = server.stats().num_total_blocks
            for plan, reqs, (audit, _) in zip(plans, loads, audits, strict=True):
                _, served = served_profile.screen(profile, plan.contract, plan.workload.classes)
                per_s = sum(map(float, served.partitions(plan.contract.model.iteration_ms)))
                got = [audit, sim_row(profile, config, reqs, num_blocks)]
                if server is not None:
                    started = time.perf_counter()
                    got.append(real_row(server, reqs, per_s, deadline_s, log))
                    log(f"{plan.name}: {len(reqs)} requests served in "
                        f"{time.perf_counter() - started:.0f} s")
                for row in got:
                    row.setdefault("verdict", judge(plan.contract, row))
                    rows.append({"workload": plan.name, **row})
        finally:
            if server is not None:
                server.stop()
    return rows


def _start(k: Contract, config: SchedulerConfig, tmp: str, log):
    from benchmarks import sim_server
    from benchmarks.sim_validate import Workload

    started = time.perf_counter()
    server = sim_server.start(Workload(kv_cache_bytes=k.kv_memory_bytes), config, tmp)
    log(f"continuum serve ready ({time.perf_counter() - started:.0f} s): chunked, "
        f"{config.max_num_seqs} sequences, chunk {config.chunk_size}, budget "
        f"{config.max_num_batched_tokens} tokens/step")
    return server


def agreement(rows: list[dict]) -> list[str]:
    """Per workload: the three verdicts (WITHIN / EXCEEDS) and whether they agree."""
    lines = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        verdicts = {r["source"]: r["verdict"].split()[0] for r in rows if r["workload"] == name}
        same = len(set(verdicts.values())) == 1
        lines.append(f"{name}: " + ", ".join(f"{s} {v}" for s, v in verdicts.items())
                     + f" -> {'agree' if same else 'DISAGREE'}")
    return lines


def _profile(path: Path | None, log) -> ExecutorProfile:
    if path is None:
        path = Path("profiles") / f"{socket.gethostname()}.json"
        if not path.exists():
            log(f"no profile at {path}: fitting a quick one (benchmarks.fit_profile --quick)")
            subprocess.run([sys.executable, "-m", "benchmarks.fit_profile", "--quick",
                            "--out", str(path)], check=True)
    return ExecutorProfile.load(path)


def main(argv: list[str] | None = None) -> int:
    from sim.report import table

    p = argparse.ArgumentParser(prog="python -m benchmarks.capacity_check",
                                description=__doc__.split("\n")[0])
    p.add_argument("--profile", type=Path, default=None,
                   help="a fitted profile (default profiles/<hostname>.json, fitted if absent)")
    p.add_argument("--contract", type=Path, default=CONTRACT)
    p.add_argument("--workload", type=Path, action="append", default=None,
                   help="a workload bound to the contract (repeat; default: the local "
                        "within-bound and over-bound ones)")
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--quick", action="store_true",
                   help="4 s of arrivals, real runs cut at 15 s (CI)")
    p.add_argument("--no-real", action="store_true", help="audit and simulator only")
    p.add_argument("--real-deadline-s", type=float, default=None,
                   help="cut each real run this long after its start (default 3 × "
                        "duration + 120 s; --quick 15 s): what is left counts as unfinished")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    duration = 4.0 if args.quick else args.duration_s
    if not 0 < duration < math.inf:
        p.error("--duration-s must be > 0")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        profile = _profile(args.profile, log)
        plans = [load_plan(args.contract, w) for w in (args.workload or WORKLOADS)]
    except (ValueError, OSError, AuditError) as exc:
        print(f"capacity_check: {exc}", file=sys.stderr)
        return 2
    print(profile.describe())
    deadline = args.real_deadline_s or (15.0 if args.quick else None)
    rows = check(profile, plans, duration, real=not args.no_real, seed=args.seed,
                 deadline_s=deadline, log=log)
    print(table(rows))
    print("\n".join(agreement(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

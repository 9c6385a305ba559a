"""Row 4: the chaos matrix: process faults while streams run, every stream accounted for
(docs/reliability.md).

Each row replays the fixed gRPC streams of a fault-free reference run, injects one fault,
and sorts each stream into one column: ``identical``, ``duplicated`` (a stretch re-sent),
``diverged``, ``lost`` (no terminal answer by the deadline), ``errored``, or ``ended`` (by
the fault, where the design says it must). ``recovery_s``: fault to the first token after
it, worst stream. ``run_serve`` takes a ``continuum serve`` (CI); ``chaos_layouts.run_matrix``
starts replicas and gateways itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Callable

from continuum.bench.clients import Outcome
from harness import servers
from harness.streams import grpc_stream_accepted, request

SIZES = {"ci": dict(streams=4, max_tokens=12, hang_s=10.0),
         "short": dict(streams=6, max_tokens=24, hang_s=20.0),
         "default": dict(streams=8, max_tokens=32, hang_s=30.0),
         "long": dict(streams=16, max_tokens=64, hang_s=60.0)}
STREAM_TIMEOUT_S = 180.0
COLUMNS = ("identical", "duplicated", "diverged", "lost", "errored", "ended")


def requests(n: int, max_tokens: int, long_prompts: bool = False) -> list:
    out = []
    for i in range(n):
        text = f"Tell a short story about the number {i}."
        if long_prompts:  # several hundred tokens: prefill spans steps, swaps move many blocks
            text += " Background: " + " ".join(f"fact {i}.{k} is true;" for k in range(30))
        seed = None if i % 2 == 0 else 1000 + i
        out.append(request(text, max_tokens, seed=seed, temperature=0.0 if seed is None
                           else 0.9))
    return out


async def _run(addrs: list[str], reqs: list, watch: Callable | None) -> list[Outcome]:
    """Streams ``reqs`` (round-robin over ``addrs``); ``watch(outcomes)`` runs alongside
    and injects the fault; returns once every stream ended."""
    outs = [Outcome() for _ in reqs]
    tasks = [asyncio.create_task(grpc_stream_accepted(addrs[i % len(addrs)], r, out=outs[i],
                                                      timeout=STREAM_TIMEOUT_S))
             for i, r in enumerate(reqs)]
    if watch is not None:
        await watch(outs)
    await asyncio.gather(*tasks)
    return outs


def reference(addrs: list[str], reqs: list) -> list[list[int]]:
    outs = asyncio.run(_run(addrs, reqs, None))
    bad = [o for o in outs if o.status != "ok"]
    if bad:
        raise servers.ServerError(f"the reference run failed: {bad[0].status} {bad[0].detail}")
    return [o.token_ids for o in outs]


def duplicated(got: list[int], ref: list[int]) -> bool:
    """``got`` is ``ref`` with a stretch delivered twice at the first point they differ."""
    k = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
             min(len(got), len(ref)))
    for j in range(1, k + 1):
        tail = ref[k - j:]
        if got[k:] == tail[:len(got) - k] and len(got) > k:
            return True
    return False


def classify(out: Outcome, ref: list[int], expect_end: bool = False) -> str:
    if out.status == "deadline":
        return "lost"
    if out.status != "ok":
        return "ended" if expect_end else "errored"
    if out.token_ids == ref:
        return "identical"
    return "duplicated" if duplicated(out.token_ids, ref) else "diverged"


@dataclasses.dataclass
class Fault:
    """What to do, and when: ``ready(outs, stats)`` says the moment has come."""

    name: str
    phase: str
    act: Callable[[], None]
    ready: Callable[[list[Outcome], object], bool]
    stats: Callable[[], object]
    undo: Callable[[], None] | None = None  # after hang_s (SIGCONT)
    expect_end: Callable[[int], bool] = lambda i: False


def run_fault(addrs: list[str], reqs: list, ref: list[list[int]], fault: Fault,
              hang_s: float) -> dict:
    info: dict = {}

    async def watch(outs: list[Outcome]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            stats = await asyncio.to_thread(_safe, fault.stats)
            if stats is not None and fault.ready(outs, stats):
                break
            await asyncio.sleep(0.02)
        info["phase_hit"] = time.monotonic() < deadline
        info["tokens_at_fault"] = sum(len(o.token_ids) for o in outs)
        info["at"] = time.monotonic()
        fault.act()
        if fault.undo is not None:
            await asyncio.sleep(hang_s)
            fault.undo()

    outs = asyncio.run(_run(addrs, reqs, watch))
    at = info["at"]
    cols = dict.fromkeys(COLUMNS, 0)
    for i, (out, r) in enumerate(zip(outs, ref, strict=True)):
        cols[classify(out, r, fault.expect_end(i))] += 1
    gaps = [next(t for t in o.chunk_times if t > at) - at for o in outs
            if any(t > at for t in o.chunk_times) and any(t <= at for t in o.chunk_times)]
    starts = [o.chunk_times[0] - at for o in outs if o.chunk_times and o.chunk_times[0] > at]
    recovery = max(gaps + starts, default=None)
    return {"row": "chaos", "fault": fault.name, "phase": fault.phase, "streams": len(outs),
            **cols,
            "recovery_s": None if recovery is None else round(recovery, 2),
            "phase_hit": info["phase_hit"], "tokens_at_fault": info["tokens_at_fault"],
            "errors_seen": sorted({f"{o.code}: {o.detail[:100]}" for o in outs
                                   if o.status not in ("ok",)})[:3]}


def _safe(fn):
    try:
        return fn()
    except Exception:  # a stopped or dead process: the watcher just polls again
        return None


def _signal(pid_fn: Callable[[], int], sig: int) -> Callable[[], None]:
    state: dict = {}

    def act() -> None:
        state["pid"] = pid_fn()
        os.kill(state["pid"], sig)
    act.state = state  # type: ignore[attr-defined]
    return act


def _cont(act) -> Callable[[], None]:
    def undo() -> None:
        try:
            os.kill(act.state["pid"], signal.SIGCONT)
        except (ProcessLookupError, KeyError):
            pass
    return undo


def in_prefill(outs, stats) -> bool:
    return stats.num_running > 0 and all(not o.token_ids for o in outs)


def in_decode(outs, stats) -> bool:
    return all(len(o.token_ids) >= 4 for o in outs)


def executor_faults(pid_fn, stats_fn, phase: str, ready) -> list[Fault]:
    kill = _signal(pid_fn, signal.SIGKILL)
    stop = _signal(pid_fn, signal.SIGSTOP)
    return [Fault("executor kill -9", phase, kill, ready, stats_fn),
            Fault("executor SIGSTOP", phase, stop, ready, stats_fn, undo=_cont(stop))]


def run_serve(serve: servers.Serve, size: str = "short") -> list[dict]:
    """The CI form: executor kill -9 during decode, on a ``continuum serve``."""
    cfg = SIZES[size]
    reqs = requests(cfg["streams"], cfg["max_tokens"])
    ref = reference([serve.addr], reqs)
    fault = executor_faults(lambda: serve.pid("executor_svc"), serve.stats, "decode",
                            in_decode)[0]
    row = run_fault([serve.addr], reqs, ref, fault, cfg["hang_s"])
    servers.wait_idle(serve.scheduler_port, 60)
    return [row]


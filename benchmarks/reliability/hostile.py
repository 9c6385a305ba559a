"""Row 5: a normal stream's inter-token latency with and without hostile-but-valid traffic
(docs/reliability.md).

One normal client streams greedy completions back to back; its ITL p99 is measured alone
and while ``rate`` requests/s of each mix arrive (hostile_load.py): ``costly`` (cost not in
their tokens, as large as the caps allow), ``benign`` (their twins: the same paid work
without what the caps bound) and ``heavy`` (prompts as long as the pool holds). The target
row compares costly with benign (ratio <= 1.2). ``--per-kind`` runs each costly kind alone
against its twin (twin, kind, kind, twin). Every phase also probes the gateway's and the
scheduler's event loops; the hostile requests come from their own process.

    .venv/bin/python -m benchmarks.reliability --only hostile [--long] [--per-kind]
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import sys
import time
import urllib.request

import aiohttp
import grpc

from benchmarks.reliability.hostile_load import (
    Kind,
    Sender,
    benign_twin,
    costly_kinds,
    heavy_kinds,
)
from continuum.bench.clients import Outcome, grpc_stream
from harness import servers
from harness.streams import request
from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc
from sim.metrics import itl_gaps, percentile

SIZES = {"short": dict(seconds=12.0, rate=20.0, kind_seconds=5.0),
         "default": dict(seconds=30.0, rate=20.0, kind_seconds=10.0),
         "long": dict(seconds=90.0, rate=20.0, kind_seconds=30.0)}
NORMAL_TOKENS = 48
LIVE_EVERY_S = 0.04  # the gateway loop probe: 25 GET /live a second
STATS_EVERY_S = 0.1  # the scheduler loop probe: 10 Stats a second


@dataclasses.dataclass
class Phase:
    """What one phase measured: the normal stream's ITLs and the two loop probes'
    round trips (seconds), the CPU seconds each server process used, and every
    stream's outcome by kind and status."""

    itls: list[float] = dataclasses.field(default_factory=list)
    cpu_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    live_rtts: list[float] = dataclasses.field(default_factory=list)
    stats_rtts: list[float] = dataclasses.field(default_factory=list)
    seen: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def __iadd__(self, other: Phase) -> Phase:
        self.itls += other.itls
        self.live_rtts += other.live_rtts
        self.stats_rtts += other.stats_rtts
        self.cpu_s.update(other.cpu_s)
        self.seen.update(other.seen)
        return self


async def _normal(serve: servers.Serve, end: float, seen: collections.Counter) -> list[float]:
    """The normal client's ITLs; a refusal is counted and waited out as its hint says.
    The stream running at ``end`` is cancelled there (its gaps so far count), so that a
    phase lasts ``seconds`` however slow the machine makes each stream."""
    itls: list[float] = []
    async with grpc.aio.insecure_channel(serve.addr) as ch:
        i = 0
        while time.monotonic() < end:
            out = Outcome()
            try:
                await asyncio.wait_for(grpc_stream(serve.addr, request(
                    f"Describe city number {i}.", NORMAL_TOKENS), channel=ch, out=out),
                    max(0.1, end - time.monotonic()))
            except TimeoutError:
                out.status = "cancelled"  # the phase ended, not the stream
            itls += itl_gaps(out.chunk_times)
            if out.status not in ("ok", "cancelled"):
                seen[f"normal stream: {out.status} {out.code}"] += 1
                await asyncio.sleep(min(5.0, out.retry_after_s or 1.0))
            i += 1
    return itls


async def _probe_live(http_port: int, end: float) -> list[float]:
    """Round trips of ``GET /live`` (no auth, no work: the time the gateway's loop takes
    to get to it)."""
    rtts: list[float] = []
    url = f"http://127.0.0.1:{http_port}/live"
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                pass  # a probe that failed measured nothing; the row counts streams
            else:
                rtts.append(time.monotonic() - started)
            await asyncio.sleep(LIVE_EVERY_S)
    return rtts


async def _probe_stats(scheduler_port: int, end: float) -> list[float]:
    """Round trips of the scheduler's ``Stats`` (served on the loop that runs its steps)."""
    rtts: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler_port}") as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                await stub.Stats(scheduler_pb2.StatsRequest(), timeout=30,
                                 metadata=servers.internal_metadata())
            except grpc.RpcError:
                pass
            else:
                rtts.append(time.monotonic() - started)
            await asyncio.sleep(STATS_EVERY_S)
    return rtts


async def _phase(serve: servers.Serve, sender: Sender, seconds: float, rate: float | None,
                 kinds: list[Kind]) -> Phase:
    end = time.monotonic() + seconds
    phase = Phase()
    pids = servers.children_by_role(serve.proc.pid)
    before = servers.cpu_seconds(pids)
    normal = asyncio.create_task(_normal(serve, end, phase.seen))
    live = asyncio.create_task(_probe_live(serve.http_port, end))
    stats = asyncio.create_task(_probe_stats(serve.scheduler_port, end))
    if rate:
        phase.seen.update(await sender.send(kinds, end, rate))
    phase.itls, phase.live_rtts, phase.stats_rtts = await asyncio.gather(normal, live, stats)
    phase.cpu_s = servers.cpu_seconds(pids)
    phase.cpu_s.subtract(before)
    return phase


def _counter(serve: servers.Serve):
    """``count_tokens(path, body)``: the served tokenizer's prompt token count."""
    def count(path: str, body: dict) -> int:
        data = json.dumps({"model": "", **{k: v for k, v in body.items()
                                           if k in ("prompt", "messages")}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{serve.http_port}/tokenize", data,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.load(resp)["count"]
    return count


def run(serve: servers.Serve, size: str = "default", per_kind: bool = False) -> list[dict]:
    """The mix rows (or, ``per_kind``, one row per costly kind against its twin)."""
    cfg = SIZES[size]
    sender = Sender(serve.addr, serve.http_port)
    try:
        asyncio.run(_phase(serve, sender, 3.0, None, []))  # warm the normal path
        costly = costly_kinds(serve.stats().max_model_len or 8192)
        count = _counter(serve)
        twins = [benign_twin(kind, count) for kind in costly]
        if per_kind:
            return [_one_kind(serve, sender, cfg, kind, twin) for kind, twin in zip(
                costly, twins, strict=True)]
        return _mixes(serve, sender, cfg, costly, twins)
    finally:
        sender.close()


def _mixes(serve: servers.Serve, sender: Sender, cfg: dict, costly: list[Kind],
           twins: list[Kind]) -> list[dict]:
    """Three rows on one quiet baseline: the costly mix against its benign twin (the
    same paid work without what the caps bound; target ratio 1.2) and against quiet,
    and the heavy mix against quiet (reported: what the scheduler lets long prompts do
    to a stream)."""
    quiet = asyncio.run(_phase(serve, sender, cfg["seconds"], None, []))
    stats = serve.stats()
    heavy = heavy_kinds(stats.max_model_len or 8192, stats.num_total_blocks * stats.block_size)
    # The target's two sides in halves, benign, costly, costly, benign: a drift of the
    # machine's load weighs on both alike (one phase each, in a fixed order, did not).
    half = cfg["seconds"] / 2
    loud: dict[str, Phase] = {"benign": Phase(), "costly": Phase(), "heavy": Phase()}
    for mix, kinds, seconds in (("benign", twins, half), ("costly", costly, half),
                                ("costly", costly, half), ("benign", twins, half),
                                ("heavy", heavy, cfg["seconds"])):
        loud[mix] += asyncio.run(_phase(serve, sender, seconds, cfg["rate"], kinds))
        servers.wait_idle(serve.scheduler_port, 120)
    for phase in loud.values():
        phase.seen.update(quiet.seen)
    idle = servers.wait_idle(serve.scheduler_port, 120)
    return [_row("costly", "its benign twin", 1.2, cfg, loud["benign"], loud["costly"], idle),
            _row("costly", "quiet", None, cfg, quiet, loud["costly"], idle),
            _row("heavy", "quiet", None, cfg, quiet, loud["heavy"], idle)]


def _one_kind(serve: servers.Serve, sender: Sender, cfg: dict, kind: Kind,
              twin: Kind) -> dict:
    """One costly kind alone at the row's rate against its twin alone: twin, kind,
    kind, twin, so that a drift of the machine's load weighs on both sides alike."""
    without, with_ = Phase(), Phase()
    for side, kinds in ((without, [twin]), (with_, [kind]), (with_, [kind]),
                        (without, [twin])):
        side += asyncio.run(_phase(serve, sender, cfg["kind_seconds"], cfg["rate"], kinds))
        servers.wait_idle(serve.scheduler_port, 120)
    row = _row(kind[0], "its benign twin", None, {**cfg, "seconds": 2 * cfg["kind_seconds"]},
               without, with_, servers.wait_idle(serve.scheduler_port, 120))
    print(f"[hostile] {kind[0]}: ITL p99 {row['itl_p99_ms_without']} -> "
          f"{row['itl_p99_ms_with']} ms ({row['ratio_p99']}x); gateway /live p99 "
          f"{row['gateway_live_rtt_ms_p99']} ms; scheduler Stats p99 "
          f"{row['scheduler_stats_rtt_ms_p99']} ms; CPU s {row['cpu_s']} (twin, kind)",
          file=sys.stderr, flush=True)
    return {**row, "twin_body": _shown(twin[2]), "kind_body": _shown(kind[2])}


def _shown(body: dict) -> str:
    return json.dumps(body)[:300]


def _row(mix: str, against: str, target: float | None, cfg: dict, quiet: Phase,
         loud: Phase, idle) -> dict:
    p99_quiet, p99_loud = percentile(quiet.itls, 99), percentile(loud.itls, 99)
    ratio = p99_loud / p99_quiet if p99_quiet > 0 and p99_loud > 0 else None
    seen = loud.seen
    return {
        "row": "hostile_itl", "mix": mix, "against": against,
        "seconds_per_phase": cfg["seconds"],
        "hostile_rps": cfg["rate"],
        "itl_p99_ms_without": _ms(p99_quiet), "itl_p99_ms_with": _ms(p99_loud),
        "itl_p50_ms_without": _ms(percentile(quiet.itls, 50)),
        "itl_p50_ms_with": _ms(percentile(loud.itls, 50)),
        "ratio_p99": None if ratio is None else round(ratio, 2), "target_ratio": target,
        "itl_samples": [len(quiet.itls), len(loud.itls)],
        # The loops' responsiveness, [without, with]: p99 and max round trip (ms).
        "gateway_live_rtt_ms_p99": [_ms(percentile(p.live_rtts, 99)) for p in (quiet, loud)],
        "gateway_live_rtt_ms_max": [_ms(max(p.live_rtts, default=None)) for p in (quiet, loud)],
        "scheduler_stats_rtt_ms_p99": [_ms(percentile(p.stats_rtts, 99)) for p in (quiet, loud)],
        "scheduler_stats_rtt_ms_max": [_ms(max(p.stats_rtts, default=None))
                                       for p in (quiet, loud)],
        # CPU seconds each process used in the phase(s), [without, with].
        "cpu_s": {role: [round(p.cpu_s[role], 2) for p in (quiet, loud)]
                  for role in sorted(set(quiet.cpu_s) | set(loud.cpu_s))},
        "hostile_outcomes": dict(seen),
        "server_errors": sum(v for k, v in seen.items() if "server_error" in k),
        "normal_not_ok": sum(v for k, v in seen.items() if k.startswith("normal stream")),
        "idle_after": idle.num_running == 0 and idle.num_waiting == 0,
    }


def _ms(seconds: float | None) -> float | None:
    """Milliseconds, or None for no figure (a percentile of nothing is NaN)."""
    return None if seconds is None or seconds != seconds else round(seconds * 1000, 1)

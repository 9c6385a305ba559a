"""Row 1: overload at 10x measured capacity.

Capacity first: a closed loop of ``concurrency`` clients, each starting its next request
when the last one finished, for a few seconds; capacity = completed requests / s. Then an
open loop offers 10x that (Poisson arrivals, alternating gRPC and HTTP, each its own
connection, as many clients would) for ``offer_s`` seconds. What a well-behaved server
does (docs/design.md §3): refuse at once what it cannot start within its queue bound
(429 / RESOURCE_EXHAUSTED with a retry hint), keep the accepted requests' TTFT, and keep its
memory bounded. A request the server neither refused nor answered within the client's
``deadline_s`` counts as ``no_answer``: the silent queueing the design forbids.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from continuum.bench.clients import Outcome, grpc_stream, http_stream
from harness import servers
from harness.streams import completion_body, request
from sim.metrics import percentile

SIZES = {  # closed-loop concurrency, capacity seconds, offer seconds, most offered, deadline
    "ci": dict(concurrency=4, capacity_s=2.0, offer_s=2.0, max_offered=40, deadline_s=15.0),
    "short": dict(concurrency=8, capacity_s=4.0, offer_s=4.0, max_offered=300, deadline_s=30.0),
    "default": dict(concurrency=16, capacity_s=8.0, offer_s=8.0, max_offered=800,
                    deadline_s=60.0),
    "long": dict(concurrency=32, capacity_s=15.0, offer_s=20.0, max_offered=3000,
                 deadline_s=120.0),
}
MAX_TOKENS = 16


async def _one(serve: servers.Serve, session: aiohttp.ClientSession, i: int,
               deadline_s: float) -> Outcome:
    prompt = f"Count slowly from {i} to {i + 20}:"
    if i % 2:
        url = f"http://127.0.0.1:{serve.http_port}/v1/completions"
        return await http_stream(session, url, completion_body(prompt, MAX_TOKENS),
                                 timeout=deadline_s)
    return await grpc_stream(serve.addr, request(prompt, MAX_TOKENS, chat=False),
                             timeout=deadline_s)


async def capacity(serve: servers.Serve, concurrency: int, seconds: float) -> float:
    """Completed requests per second with ``concurrency`` closed-loop clients."""
    done = 0
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() < end:
                out = await _one(serve, session, i, 120.0)
                if out.status == "ok":
                    done += 1
                elif out.status == "refused":  # wait as the hint says, not a hot loop
                    await asyncio.sleep(min(5.0, out.retry_after_s or 1.0))
                i += concurrency
        started = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
    return done / (time.monotonic() - started)


async def offer(serve: servers.Serve, rate: float, seconds: float, max_offered: int,
                deadline_s: float, rss: list[int]) -> list[Outcome]:
    rng = random.Random(15)
    tasks: list[asyncio.Task] = []
    pids = [serve.pid("gateway"), serve.pid("scheduler_svc")]

    async def sample() -> None:
        while True:
            rss.append(sum(servers.rss_kib(p) for p in pids))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end and i < max_offered:
            tasks.append(asyncio.create_task(_one(serve, session, 10_000 + i, deadline_s)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        outcomes = await asyncio.gather(*tasks)
    sampler.cancel()
    return list(outcomes)


def run(serve: servers.Serve, size: str = "short") -> dict:
    cfg = SIZES[size]
    pids = [serve.pid("gateway"), serve.pid("scheduler_svc")]
    rss_before = sum(servers.rss_kib(p) for p in pids)
    cap = asyncio.run(capacity(serve, cfg["concurrency"], cfg["capacity_s"]))
    rate = 10 * max(cap, 0.5)
    samples: list[int] = []
    outcomes = asyncio.run(offer(serve, rate, cfg["offer_s"], cfg["max_offered"],
                                 cfg["deadline_s"], samples))
    idle = servers.wait_idle(serve.scheduler_port, 60)
    rss_after = sum(servers.rss_kib(p) for p in pids)
    refused = [o for o in outcomes if o.status == "refused"]
    accepted = [o for o in outcomes if o.status == "ok"]
    return {
        "row": "overload_10x", "capacity_rps": round(cap, 2), "offered_rps": round(rate, 1),
        "offered": len(outcomes), "refused": len(refused),
        "refused_frac": round(len(refused) / max(1, len(outcomes)), 3),
        "refused_with_retry_hint": sum(o.retry_hint for o in refused),
        "refuse_p99_s": _round(percentile([o.elapsed_s for o in refused], 99)),
        "completed": len(accepted),
        "accepted_ttft_p99_s": _round(percentile([o.ttft_s for o in accepted], 99)),
        "no_answer": sum(o.status == "deadline" for o in outcomes),
        "server_errors": sum(o.status == "server_error" for o in outcomes),
        "errors_seen": sorted({f"{o.api}:{o.code}:{o.detail[:80]}" for o in outcomes
                               if o.status == "server_error"})[:5],
        "rss_mib_before": round(rss_before / 1024, 1),
        "rss_mib_peak": round(max(samples or [0]) / 1024, 1),
        "rss_mib_after": round(rss_after / 1024, 1),
        "idle_after": idle.num_running == 0 and idle.num_waiting == 0,
        "deadline_s": cfg["deadline_s"],
    }


def _round(value: float | None) -> float | None:
    """Rounded, or None for no figure (a percentile of nothing is NaN)."""
    return None if value is None or value != value else round(value, 3)

"""Row 2: a soak with random cancels, disconnects and client deadlines.

``clients`` concurrent clients over both APIs, each in a loop, pick one of: a full
stream (must finish), gRPC ``call.cancel()`` after a random number of tokens, an HTTP
connection dropped after a random number of SSE chunks, a short client deadline, or a
stream abandoned at a random instant (the task is cancelled: before its first token as
often as after). The soak runs in two halves with an idle check after each: nothing
running or waiting, every KV block free (Stats counts cached-but-unowned prefix blocks
as free), no sequence state left on the executor. The second idle point is compared with
the first: the fds and RSS of the gateway, scheduler and executor must not grow beyond a
small tolerance (the first half warms every path, so growth after it is a leak).
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from continuum.bench.clients import Outcome, grpc_stream, http_stream
from harness import servers
from harness.streams import completion_body, request

SIZES = {"ci": dict(clients=4, seconds=8.0), "short": dict(clients=6, seconds=16.0),
         "default": dict(clients=12, seconds=60.0), "long": dict(clients=24, seconds=600.0)}
ACTIONS = ("complete", "grpc_cancel", "http_close", "deadline", "abandon")
FD_TOLERANCE = 8  # per process: a reconnecting channel or a lazily opened file
RSS_TOLERANCE_KIB = 32 << 10  # per process: allocator noise after the warm-up half


async def _action(serve: servers.Serve, session: aiohttp.ClientSession, rng: random.Random,
                  i: int) -> tuple[str, Outcome]:
    action = rng.choice(ACTIONS)
    max_tokens = rng.randint(4, 40)
    prompt = f"Write about soak topic {i % 7}, item {i}."
    url = f"http://127.0.0.1:{serve.http_port}/v1/completions"
    use_http = rng.random() < 0.5
    timeout = rng.uniform(0.2, 2.0) if action == "deadline" else 120.0

    def make():
        if action == "grpc_cancel" or (not use_http and action != "http_close"):
            cancel = rng.randint(1, max_tokens - 1) if action == "grpc_cancel" else None
            return grpc_stream(serve.addr, request(prompt, max_tokens), timeout=timeout,
                               cancel_after=cancel)
        close = rng.randint(1, max_tokens - 1) if action == "http_close" else None
        return http_stream(session, url, completion_body(prompt, max_tokens),
                           timeout=timeout, close_after=close)

    if action != "abandon":
        return action, await make()
    task = asyncio.ensure_future(make())
    try:
        return action, await asyncio.wait_for(task, rng.uniform(0.05, 1.5))
    except TimeoutError:
        return action, Outcome(api="http" if use_http else "grpc", status="cancelled")


async def _soak(serve: servers.Serve, clients: int, seconds: float, seed: int) -> list:
    results: list[tuple[str, Outcome]] = []
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(k: int) -> None:
            rng = random.Random(seed * 1000 + k)
            i = k
            while time.monotonic() < end:
                action, out = await _action(serve, session, rng, i)
                results.append((action, out))
                if out.status == "refused":  # a polite client waits as the hint says
                    await asyncio.sleep(min(5.0, out.retry_after_s or 1.0))
                i += clients
        await asyncio.gather(*(client(k) for k in range(clients)))
    return results


def _idle_point(serve: servers.Serve) -> dict:
    stats = servers.wait_idle(serve.scheduler_port, 60)
    deadline = time.monotonic() + 15  # the executor reports its state in heartbeats
    while stats.executor_num_sequences and time.monotonic() < deadline:
        time.sleep(0.5)
        stats = serve.stats()
    time.sleep(1.0)  # let closed connections' fds go
    pids = {role: serve.pid(role) for role in servers.ROLES}
    return {
        "stats": stats,
        "fds": {r: servers.num_fds(p) for r, p in pids.items()},
        "rss": {r: servers.rss_kib(p) for r, p in pids.items()},
    }


def _clean(stats) -> bool:
    return (stats.num_running == 0 and stats.num_waiting == 0
            and stats.num_free_blocks == stats.num_total_blocks
            and stats.executor_num_sequences == 0)


def run(serve: servers.Serve, size: str = "short") -> dict:
    cfg = SIZES[size]
    half = cfg["seconds"] / 2
    first = asyncio.run(_soak(serve, cfg["clients"], half, 1))
    idle1 = _idle_point(serve)
    second = asyncio.run(_soak(serve, cfg["clients"], half, 2))
    idle2 = _idle_point(serve)
    results = first + second
    fd_growth = {r: idle2["fds"][r] - idle1["fds"][r] for r in servers.ROLES}
    rss_growth = {r: round((idle2["rss"][r] - idle1["rss"][r]) / 1024, 1) for r in servers.ROLES}
    completes = [o for a, o in results if a == "complete"]
    by_action = {a: sum(1 for b, _ in results if b == a) for a in ACTIONS}
    s = idle2["stats"]
    return {
        "row": "soak", "seconds": cfg["seconds"], "clients": cfg["clients"],
        "streams": len(results), "by_action": by_action,
        "completed_ok": sum(o.status == "ok" for o in completes),
        "refused": sum(o.status == "refused" for _, o in results),
        # A full stream with no terminal answer before its (long) deadline, or one that
        # ended in a status a full stream must not get (cancelled by nobody, bad input).
        "lost": sum(o.status not in ("ok", "server_error", "refused") for o in completes),
        "server_errors": sum(o.status == "server_error" for _, o in results),
        "errors_seen": sorted({f"{a}:{o.api}:{o.code}:{o.detail[:80]}" for a, o in results
                               if o.status == "server_error"})[:5],
        "idle_clean_1": _clean(idle1["stats"]), "idle_clean_2": _clean(s),
        "blocks_free": f"{s.num_free_blocks}/{s.num_total_blocks}",
        "running_waiting": f"{s.num_running}/{s.num_waiting}",
        "executor_sequences": s.executor_num_sequences,
        "fd_growth": fd_growth, "rss_growth_mib": rss_growth,
        "fds_ok": all(v <= FD_TOLERANCE for v in fd_growth.values()),
        "rss_ok": all(v * 1024 <= RSS_TOLERANCE_KIB for v in rss_growth.values()),
    }

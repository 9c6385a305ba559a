"""Row: a burst of completions sent at once, each on a connection of its own.

What must hold (a burst into an empty queue): every request gets an HTTP status, none
a reset or a close without an answer; what the server cannot start within its queue
bound is refused at once (429 with ``Retry-After``; the refusals' p99 within
``REFUSAL_P99_S`` of sending); what it admits is served to its end. The burst is
sent by a process of its own (so the figures are not this loop's), from
``SOURCES`` loopback addresses (127.0.0.2 and up: many clients, each under the
gateway's per-client connection cap, so the refusals measured are the scheduler's
admission's, not that cap's).

    .venv/bin/python -m benchmarks.reliability --only burst [--short | --long]
"""

from __future__ import annotations

import asyncio
import collections
import json
import multiprocessing
import time

import aiohttp

from benchmarks.reliability import procs
from benchmarks.reliability.streams import http_stream, percentile

SIZES = {"ci": 100, "short": 300, "default": 1000, "long": 2000}
REFUSAL_P99_S = 2.0
SOURCES = 8
MAX_TOKENS = 16
DEADLINE_S = 180.0


async def _burst(url: str, count: int) -> list[tuple[str, str, float, int]]:
    """(status, code, seconds from sending, tokens) per request, all sent at once."""
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(
        limit=0, force_close=True, local_addr=(f"127.0.0.{2 + k}", 0))) for k in range(SOURCES)]
    try:
        start = asyncio.Event()

        async def one(i: int):
            await start.wait()
            sent = time.monotonic()
            out = await http_stream(sessions[i % SOURCES], url, {
                "prompt": f"Burst {i}: the weather today", "max_tokens": MAX_TOKENS,
                "temperature": 0}, timeout=DEADLINE_S)
            return out.status, out.code, time.monotonic() - sent, len(out.text)

        tasks = [asyncio.create_task(one(i)) for i in range(count)]
        await asyncio.sleep(0.1)
        start.set()
        return await asyncio.gather(*tasks)
    finally:
        for session in sessions:
            await session.close()


def _send(url: str, count: int) -> list:
    return asyncio.run(_burst(url, count))


def run(serve: procs.Serve, size: str = "default") -> dict:
    count = SIZES[size]
    procs.wait_idle(serve.scheduler_port, 60)
    url = f"http://127.0.0.1:{serve.http_port}/v1/completions"
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        results = pool.apply(_send, (url, count))
    idle = procs.wait_idle(serve.scheduler_port, 120)
    seen = collections.Counter(f"{status} {code}".strip() for status, code, _, _ in results)
    refused = [s for status, code, s, _ in results if code == "429"]
    served = [s for status, code, s, _ in results if status == "ok"]
    unanswered = sum(1 for status, code, _, _ in results if not code)
    return {
        "row": "burst", "sent": count, "outcomes": dict(seen),
        "served": len(served), "refused_429": len(refused),
        "no_http_answer": unanswered,
        "other": count - len(served) - len(refused),
        "refusal_p50_s": _round(percentile(refused, 50)),
        "refusal_p99_s": _round(percentile(refused, 99)),
        "served_p50_s": _round(percentile(served, 50)),
        "served_p99_s": _round(percentile(served, 99)),
        "target_refusal_p99_s": REFUSAL_P99_S,
        "idle_after": idle.num_running == 0 and idle.num_waiting == 0,
    }


def summary(row: dict) -> tuple[str, str, str, bool]:
    p99 = row["refusal_p99_s"]
    met = (row["no_http_answer"] == 0 and row["other"] == 0 and row["served"] > 0
           and (p99 is None or p99 <= REFUSAL_P99_S) and row["idle_after"])
    return (f"burst: {row['sent']} completions at once, a connection each",
            f"served {row['served']} (p50 {row['served_p50_s']} s, p99 "
            f"{row['served_p99_s']} s); refused 429 {row['refused_429']} (p50 "
            f"{row['refusal_p50_s']} s, p99 {p99} s from sending); no HTTP answer "
            f"{row['no_http_answer']}; other {json.dumps(row['outcomes'])}",
            f"every one answered, 0 resets; refusals' p99 <= {REFUSAL_P99_S:g} s; admitted "
            "ones served", met)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)

"""Row: a burst of completions sent at once from one client address, in three forms.

* ``a connection each``: every request on a connection of its own, as a batch job or a
  sidecar proxy sends them;
* ``pooled``: the same requests through one client's connection pool (``POOL``
  connections, keep-alive), as an SDK sends them;
* ``a connection each, N idle beside``: the first form while ``IDLE`` answered
  keep-alive connections from other addresses sit open, more than the gateway's
  2,048-connection cap.

What must hold in each: every request gets an HTTP status, none a reset or a close
without an answer; what cannot be served now is refused at once (429 with
``Retry-After``: past the client's connection cap, or past the scheduler's queue bound;
the refusals' p99 within ``REFUSAL_P99_S`` of sending); what is admitted is served to
its end. The burst is sent by a process of its own (so the figures are not this loop's).

    .venv/bin/python -m benchmarks.reliability --only burst [--short | --long]
"""

from __future__ import annotations

import asyncio
import collections
import json
import multiprocessing
import time

import aiohttp

from continuum.bench.clients import http_stream
from harness import servers
from sim.metrics import percentile

SIZES = {"ci": 100, "short": 300, "default": 1000, "long": 2000}
IDLE = {"ci": 300, "short": 2100, "default": 2100, "long": 2100}
REFUSAL_P99_S = 3.0
POOL = 100
IDLE_SOURCES = 9  # 127.0.0.2 and up: each under the per-client connection cap
MAX_TOKENS = 16
DEADLINE_S = 180.0

Result = tuple[str, str, float, int]  # (status, HTTP code or "", seconds from sending, tokens)


async def _hold_idle(port: int, count: int) -> list[asyncio.StreamWriter]:
    """``count`` keep-alive connections, each answered once and left open."""
    async def one(i: int):
        source = f"127.0.0.{2 + i % IDLE_SOURCES}"
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                           local_addr=(source, 0))
            writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            return None
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        return writer if head.startswith(b"HTTP/1.1 200") else None

    held = []
    for start in range(0, count, 256):  # in waves, as pools fill up
        held += [w for w in await asyncio.gather(*(one(i) for i in range(
            start, min(count, start + 256)))) if w is not None]
    return held


async def _burst(url: str, port: int, count: int, form: str, idle: int) -> dict:
    pooled = form == "pooled"
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
        limit=POOL if pooled else 0, force_close=not pooled))
    held = await _hold_idle(port, idle) if idle else []
    if held:
        await asyncio.sleep(1.5)  # idle long enough to be given up for a newcomer
    try:
        start = asyncio.Event()

        async def one(i: int) -> Result:
            await start.wait()
            sent = time.monotonic()
            out = await http_stream(session, url, {
                "prompt": f"Burst {i}: the weather today", "max_tokens": MAX_TOKENS,
                "temperature": 0}, timeout=DEADLINE_S)
            return out.status, out.code, time.monotonic() - sent, len(out.text)

        tasks = [asyncio.create_task(one(i)) for i in range(count)]
        await asyncio.sleep(0.1)
        start.set()
        results = await asyncio.gather(*tasks)
    finally:
        await session.close()
        for writer in held:
            writer.close()
    return {"results": results, "idle_held": len(held)}


def _send(url: str, port: int, count: int, form: str, idle: int) -> dict:
    return asyncio.run(_burst(url, port, count, form, idle))


def run(serve: servers.Serve, size: str = "default") -> list[dict]:
    """One row per form, on the same server, one after another."""
    return [_run_form(serve, size, form, idle)
            for form, idle in (("a connection each", 0), ("pooled", 0),
                               (f"a connection each, {IDLE[size]} idle beside", IDLE[size]))]


def _run_form(serve: servers.Serve, size: str, form: str, idle: int) -> dict:
    count = SIZES[size]
    servers.wait_idle(serve.scheduler_port, 60)
    url = f"http://127.0.0.1:{serve.http_port}/v1/completions"
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        sent = pool.apply(_send, (url, serve.http_port, count, form, idle))
    results = sent["results"]
    idle_after = servers.wait_idle(serve.scheduler_port, 120)
    seen = collections.Counter(f"{status} {code}".strip() for status, code, _, _ in results)
    refused = [s for status, code, s, _ in results if code == "HTTP_429"]
    served = [s for status, code, s, _ in results if status == "ok"]
    unanswered = sum(1 for status, code, _, _ in results if not code)
    return {
        "row": "burst", "form": form, "sent": count, "outcomes": dict(seen),
        "idle_held": sent["idle_held"],
        "served": len(served), "refused_429": len(refused),
        "no_http_answer": unanswered,
        "other": count - len(served) - len(refused),
        "refusal_p50_s": _round(percentile(refused, 50)),
        "refusal_p99_s": _round(percentile(refused, 99)),
        "served_p50_s": _round(percentile(served, 50)),
        "served_p99_s": _round(percentile(served, 99)),
        "target_refusal_p99_s": REFUSAL_P99_S,
        "idle_after": idle_after.num_running == 0 and idle_after.num_waiting == 0,
    }


def summary(row: dict) -> tuple[str, str, str, bool]:
    p99 = row["refusal_p99_s"]
    met = (row["no_http_answer"] == 0 and row["other"] == 0 and row["served"] > 0
           and (p99 is None or p99 <= REFUSAL_P99_S) and row["idle_after"])
    held = f"; {row['idle_held']} idle connections held" if row.get("idle_held") else ""
    return (f"burst: {row['sent']} completions at once from one address, {row['form']}",
            f"served {row['served']} (p50 {row['served_p50_s']} s, p99 "
            f"{row['served_p99_s']} s); refused 429 {row['refused_429']} (p50 "
            f"{row['refusal_p50_s']} s, p99 {p99} s from sending); no HTTP answer "
            f"{row['no_http_answer']}; other {json.dumps(row['outcomes'])}{held}",
            f"every one answered, 0 resets; refusals' p99 <= {REFUSAL_P99_S:g} s; admitted "
            "ones served", met)


def _round(value: float | None) -> float | None:
    """Rounded, or None for no figure (a percentile of nothing is NaN)."""
    return None if value is None or value != value else round(value, 2)

"""Row 5: a normal stream's inter-token latency with and without hostile-but-valid traffic.

One normal client streams greedy completions back to back (gRPC) for ``seconds``; its
ITL p99 (gaps between consecutive token messages) is measured in four phases: alone
(quiet), and while ``rate`` requests per second arrive (Poisson, a rotating mix, every
one valid input) of each mix:

* ``costly``: requests whose cost is not in their tokens, each as large as the caps
  allow: 16 stop strings of 256 bytes, a chat of 32 messages, 20 top logprobs, ``n`` 16
  with ``max_tokens`` 1, a body near the 4 MiB limit (a long ``user`` field), 128 stop
  token ids with ``min_tokens`` 1, and a gRPC stream cancelled 10 ms after it started;
* ``benign``: the costly mix's twins: the same prompts, ``max_tokens`` and ``n`` (the
  same paid work) without what the caps bound;
* ``heavy``: prompts as long as the KV pool holds (a plain one and a chat of as many
  messages as fit), which pay for their cost in prompt tokens.

The issue's target is the costly mix's ratio <= 1.2 "of its value without them". On a
GPU the paid work of 20 small requests a second costs a decode step next to nothing;
on two shared CPU cores it does not (every extra sequence in a step is compute), so
the row with the target compares the costly mix with its benign twin: what the
requests cost beyond their tokens. The ratio against quiet is printed beside it.

    .venv/bin/python -m benchmarks.reliability --only hostile [--long]
"""

from __future__ import annotations

import asyncio
import collections
import random
import time

import aiohttp
import grpc

from benchmarks.reliability import procs
from benchmarks.reliability.streams import grpc_stream, http_stream, percentile, request
from protos.continuum.v1 import generation_pb2_grpc

SIZES = {"short": dict(seconds=12.0, rate=20.0), "default": dict(seconds=30.0, rate=20.0),
         "long": dict(seconds=90.0, rate=20.0)}
NORMAL_TOKENS = 48
HOSTILE_TIMEOUT_S = 20.0
BODY_LIMIT = 4 * 1024 * 1024


def _caps() -> tuple[int, int]:
    """(most chat messages, most stop token ids) the gateway accepts."""
    from gateway import validation

    return (getattr(validation, "MAX_CHAT_MESSAGES", 1024),
            getattr(validation, "MAX_STOP_TOKEN_IDS", 49152))


def _hostile_bodies(max_model_len: int, pool_tokens: int,
                   mix: str = "costly") -> list[tuple[str, str, dict]]:
    """(kind, path, body) for every HTTP kind of ``mix``; all valid, each as large as the
    caps, the context and the KV pool allow (so none is refused as bad input).

    ``costly``: requests whose cost is not in their token count (stop strings, stop ids,
    logprobs, ``n``, a large body, a chat of many short messages: gateway and sampler
    work the issue's caps bound). ``heavy``: prompts as long as the pool holds, which
    pay for their cost in prompt tokens; what they may do to other streams' ITL is the
    scheduler's per-step prefill budget's business."""
    room = max(64, min(max_model_len, pool_tokens) - 96)
    max_messages, max_stop_ids = _caps()
    num_messages = max(2, min(max_messages, room // 10) // 2 * 2 - 1)  # ~9 tokens a turn
    heavy = [
        (f"chat {num_messages + 1} messages", "chat/completions",
         {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                       for i in range(num_messages)]
          + [{"role": "user", "content": "Sum it up."}], "max_tokens": 4}),
        (f"prompt of ~{room} tokens", "completions",
         {"prompt": "the " * room, "max_tokens": 1}),
    ]
    if mix == "heavy":
        return heavy
    few = max(2, min(max_messages, 32) // 2 * 2 - 1)
    costly = [
        ("stop strings 16x256B", "completions",
         {"prompt": "Hi", "max_tokens": 8, "stop": [f"{i:03d}" + "z" * 253 for i in range(16)]}),
        (f"chat {few + 1} messages", "chat/completions",
         {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                       for i in range(few)]
          + [{"role": "user", "content": "Sum it up."}], "max_tokens": 4}),
        ("top_logprobs 20", "chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
          "logprobs": True, "top_logprobs": 20}),
        ("n=16 max_tokens=1", "completions", {"prompt": "Once upon a time", "n": 16,
                                              "max_tokens": 1, "temperature": 1.0}),
        ("body near 4 MiB", "completions",
         {"prompt": "Hi", "max_tokens": 2, "user": "u" * (BODY_LIMIT - 4096)}),
        (f"{min(max_stop_ids, 49152)} stop token ids, min_tokens 1", "completions",
         {"prompt": "Hi", "max_tokens": 2, "min_tokens": 1,
          "stop_token_ids": list(range(min(max_stop_ids, 49152)))}),
    ]
    return [_benign_twin(*b) for b in costly] if mix == "benign" else costly


# What makes a costly kind costly without adding tokens; its benign twin drops it.
_UNPAID = ("stop", "logprobs", "top_logprobs", "user", "stop_token_ids", "min_tokens")


def _benign_twin(kind: str, path: str, body: dict) -> tuple[str, str, dict]:
    """The same paid work (prompt text, ``max_tokens``, ``n``) without what the caps
    bound: no stop strings or ids, no logprobs, a small body, one message for a chat
    of many. The control for the costly mix: what these requests' tokens alone do to
    a stream sharing the machine with them."""
    twin = {k: v for k, v in body.items() if k not in _UNPAID}
    if "messages" in twin:
        text = " ".join(m["content"] for m in twin["messages"])
        twin["messages"] = [{"role": "user", "content": text}]
    return f"benign twin of {kind}", path, twin


async def _normal(serve: procs.Serve, end: float, seen: collections.Counter) -> list[float]:
    """The normal client's ITLs; a refusal is counted and waited out as its hint says."""
    itls: list[float] = []
    async with grpc.aio.insecure_channel(serve.addr) as ch:
        i = 0
        while time.monotonic() < end:
            out = await grpc_stream(serve.addr, request(f"Describe city number {i}.",
                                                        NORMAL_TOKENS), channel=ch)
            itls += [b - a for a, b in zip(out.token_times, out.token_times[1:], strict=False)]
            if out.status != "ok":
                seen[f"normal stream: {out.status} {out.code}"] += 1
                await asyncio.sleep(min(5.0, out.retry_after_s or 1.0))
            i += 1
    return itls


async def _cancelled(serve: procs.Serve) -> str:
    async with grpc.aio.insecure_channel(serve.addr) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(request("Hello", 64))
        await asyncio.sleep(0.01)
        call.cancel()
    return "cancelled"


async def _hostile(serve: procs.Serve, end: float, rate: float, mix: str,
                   seen: collections.Counter) -> None:
    stats = serve.stats()
    bodies = _hostile_bodies(stats.max_model_len or 8192,
                             stats.num_total_blocks * stats.block_size, mix)
    rng = random.Random(20)
    tasks = []
    base = f"http://127.0.0.1:{serve.http_port}/v1/"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(k: int) -> None:
            if k % (len(bodies) + 1) == len(bodies):
                seen["cancelled right away: " + await _cancelled(serve)] += 1
                return
            kind, path, body = bodies[k % (len(bodies) + 1)]
            out = await http_stream(session, base + path, {"model": "", **body},
                                    timeout=HOSTILE_TIMEOUT_S)
            seen[f"{kind}: {out.status} {out.code}"] += 1
        k = 0
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one(k)))
            k += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


async def _phase(serve: procs.Serve, seconds: float, rate: float | None, mix: str,
                 seen: collections.Counter) -> list[float]:
    end = time.monotonic() + seconds
    normal = asyncio.create_task(_normal(serve, end, seen))
    if rate:
        await _hostile(serve, end, rate, mix, seen)
    return await normal


def run(serve: procs.Serve, size: str = "default") -> list[dict]:
    """Three rows on one quiet baseline: the costly mix against its benign twin (the
    same paid work without what the caps bound; target ratio 1.2) and against quiet,
    and the heavy mix against quiet (reported: what the scheduler lets long prompts do
    to a stream)."""
    cfg = SIZES[size]
    asyncio.run(_phase(serve, 3.0, None, "", collections.Counter()))  # warm the normal path
    quiet_seen: collections.Counter = collections.Counter()
    quiet = asyncio.run(_phase(serve, cfg["seconds"], None, "", quiet_seen))
    loud: dict[str, tuple[list[float], collections.Counter]] = {}
    for mix in ("benign", "costly", "heavy"):
        seen = collections.Counter(quiet_seen)
        loud[mix] = asyncio.run(_phase(serve, cfg["seconds"], cfg["rate"], mix, seen)), seen
        procs.wait_idle(serve.scheduler_port, 120)
    idle = procs.wait_idle(serve.scheduler_port, 120)
    benign = loud["benign"][0]
    return [_row("costly", "its benign twin", 1.2, cfg, benign, *loud["costly"], idle),
            _row("costly", "quiet", None, cfg, quiet, *loud["costly"], idle),
            _row("heavy", "quiet", None, cfg, quiet, *loud["heavy"], idle)]


def _row(mix: str, against: str, target: float | None, cfg: dict, quiet: list[float],
         loud: list[float], seen: collections.Counter, idle) -> dict:
    p99_quiet, p99_loud = percentile(quiet, 99), percentile(loud, 99)
    ratio = p99_loud / p99_quiet if p99_quiet and p99_loud else None
    return {
        "row": "hostile_itl", "mix": mix, "against": against,
        "seconds_per_phase": cfg["seconds"],
        "hostile_rps": cfg["rate"],
        "itl_p99_ms_without": _ms(p99_quiet), "itl_p99_ms_with": _ms(p99_loud),
        "itl_p50_ms_without": _ms(percentile(quiet, 50)),
        "itl_p50_ms_with": _ms(percentile(loud, 50)),
        "ratio_p99": None if ratio is None else round(ratio, 2), "target_ratio": target,
        "itl_samples": [len(quiet), len(loud)], "hostile_outcomes": dict(seen),
        "server_errors": sum(v for k, v in seen.items() if "server_error" in k),
        "normal_not_ok": sum(v for k, v in seen.items() if k.startswith("normal stream")),
        "idle_after": idle.num_running == 0 and idle.num_waiting == 0,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)

"""Row: greedy streams while requests whose structured-output specs cannot be followed arrive.

Sixteen normal clients stream greedy completions in four halves: quiet, bad, bad, quiet.
In the bad halves ``rate`` chat requests/s (hostile_load.Sender's process), each one
different, carry a spec the grammar matcher rejects. What must hold: every bad request is
refused at the edge (400) and none reaches a step (Stats' failure counters do not move);
the normal streams' outputs equal the quiet halves'; their ITL p99 is within
``TARGET_RATIO`` of the quiet halves'.

    .venv/bin/python -m benchmarks.reliability --only bad_specs [--short | --long]
"""

from __future__ import annotations

import asyncio
import collections
import json
import time

import grpc

from benchmarks.reliability.hostile_load import Kind, Sender
from continuum.bench.clients import Outcome, grpc_stream
from harness import servers
from harness.streams import request
from sim.metrics import itl_gaps, percentile

SIZES = {"ci": dict(seconds=8.0, rate=20.0, streams=16),
         "short": dict(seconds=12.0, rate=20.0, streams=16),
         "default": dict(seconds=30.0, rate=20.0, streams=16),
         "long": dict(seconds=90.0, rate=20.0, streams=16)}
NORMAL_TOKENS = 24
TARGET_RATIO = 1.2
# Stats counters that any bad request reaching a step would move.
STEP_COUNTERS = ("num_failed_steps", "num_resyncs", "num_recomputed_tokens",
                 "num_row_failures", "num_executor_dropped_sequences",
                 "num_executor_losses")


def bad_kinds(vocab_size: int, count: int) -> list[Kind]:
    """``count`` distinct chat requests, rotating through the ways a spec can fail."""
    makers = [
        lambda i: {"guided_grammar": f"start: <[{vocab_size + i}]>"},
        lambda i: {"guided_grammar": f"start: <|no_such_token_{i}|>"},
        lambda i: {"guided_regex": f"(a{{{1000 + i}}}){{{1000 + i}}}"},
        lambda i: {"guided_json": "[" * (5_000 + i) + "]" * (5_000 + i)},
        lambda i: {"response_format": {"type": "json_schema", "json_schema": {
            "name": f"s{i}", "schema": {"type": "object", "properties": {
                "a": {"type": "string", "pattern": f"(x{{{1000 + i}}}){{{1000 + i}}}"}}}}}},
        lambda i: {"tools": [{"type": "function", "function": {
            "name": f"t{i}", "parameters": {"type": "no-such-type", "minimum": i}}}],
            "tool_choice": "required"},
    ]
    kinds = []
    for i in range(count):
        extra = makers[i % len(makers)](i)
        body = {"messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4,
                **extra}
        kinds.append((f"bad spec: {next(iter(extra))}", "chat/completions", body))
    return kinds


async def _client(serve: servers.Serve, k: int, end: float, outputs: dict,
                  itls: list[float], seen: collections.Counter) -> None:
    """Stream ``k``'s completions back to back until ``end``: its i-th prompt is the same
    in every phase, so outputs compare by (k, i)."""
    async with grpc.aio.insecure_channel(serve.addr, options=(
            ("grpc.use_local_subchannel_pool", 1),)) as ch:
        i = 0
        while time.monotonic() < end:
            out = Outcome()
            await grpc_stream(serve.addr, request(f"Stream {k}, story {i}: once upon a",
                                                  NORMAL_TOKENS), channel=ch, out=out)
            seen[f"normal: {out.status} {out.code}".strip()] += 1
            if out.status == "ok":
                outputs[(k, i)] = out.token_ids
                itls += itl_gaps(out.chunk_times)
            i += 1


async def _phase(serve: servers.Serve, sender: Sender, cfg: dict, bad: list[Kind] | None):
    seconds = cfg["seconds"] / 2
    end = time.monotonic() + seconds  # the sender's clock too (every process shares it)
    outputs: dict = {}
    itls: list[float] = []
    seen: collections.Counter = collections.Counter()
    clients = [asyncio.create_task(_client(serve, k, end, outputs, itls, seen))
               for k in range(cfg["streams"])]
    if bad:
        seen.update(await sender.send(bad, end, cfg["rate"]))
    await asyncio.gather(*clients)
    return outputs, itls, seen


def run(serve: servers.Serve, size: str = "default") -> dict:
    cfg = SIZES[size]
    stats = serve.stats()
    bad = bad_kinds(stats.vocab_size or 49152, int(cfg["rate"] * cfg["seconds"] * 2))
    sender = Sender(serve.addr, serve.http_port)
    try:
        asyncio.run(_phase(serve, sender, {**cfg, "seconds": 4.0}, None))  # warm up
        before = serve.stats()
        quiet, loud = ({}, [], collections.Counter()), ({}, [], collections.Counter())
        for side, kinds in ((quiet, None), (loud, bad), (loud, bad), (quiet, None)):
            outputs, itls, seen = asyncio.run(_phase(serve, sender, cfg, kinds))
            for key, tokens in outputs.items():  # the first run of (k, i) is its reference
                side[0].setdefault(key, tokens)
            side[1].extend(itls)
            side[2].update(seen)
        after = serve.stats()
    finally:
        sender.close()
    return _row(cfg, quiet, loud, before, after, servers.wait_idle(serve.scheduler_port, 120))


def _row(cfg: dict, quiet, loud, before, after, idle) -> dict:
    common = quiet[0].keys() & loud[0].keys()
    p99_quiet, p99_loud = percentile(quiet[1], 99), percentile(loud[1], 99)
    bad_seen = {k: v for k, v in loud[2].items() if k.startswith("bad spec")}
    return {
        "row": "bad_specs", "seconds": cfg["seconds"], "rate": cfg["rate"],
        "streams": cfg["streams"],
        "bad_sent": sum(bad_seen.values()),
        "bad_refused_400": sum(v for k, v in bad_seen.items() if "client_error 400" in k),
        "bad_outcomes": bad_seen,
        "server_errors": sum(v for k, v in {**loud[2], **quiet[2]}.items()
                             if "server_error" in k),
        "normal_not_ok": sum(v for side in (quiet, loud) for k, v in side[2].items()
                             if k.startswith("normal") and not k.endswith(": ok")),
        "outputs_compared": len(common),
        "outputs_identical": sum(quiet[0][key] == loud[0][key] for key in common),
        "step_counters_moved": {name: getattr(after, name) - getattr(before, name)
                                for name in STEP_COUNTERS
                                if getattr(after, name) != getattr(before, name)},
        "itl_p99_ms_without": _ms(p99_quiet), "itl_p99_ms_with": _ms(p99_loud),
        "itl_p50_ms_without": _ms(percentile(quiet[1], 50)),
        "itl_p50_ms_with": _ms(percentile(loud[1], 50)),
        "ratio_p99": round(p99_loud / p99_quiet, 2) if p99_quiet > 0 and p99_loud > 0 else None,
        "target_ratio": TARGET_RATIO,
        "idle_after": idle.num_running == 0 and idle.num_waiting == 0,
    }


def summary(row: dict) -> tuple[str, str, str, bool]:
    """The report's (name, measured, target, met) for this row."""
    ratio = row["ratio_p99"]
    met = (row["bad_refused_400"] == row["bad_sent"] > 0 and not row["step_counters_moved"]
           and row["outputs_identical"] == row["outputs_compared"] > 0
           and row["server_errors"] == 0 and ratio is not None and ratio <= TARGET_RATIO)
    return (f"bad structured-output specs at {row['rate']:.0f} req/s under "
            f"{row['streams']} streams",
            f"{row['bad_sent']} sent, {row['bad_refused_400']} refused with 400; step "
            f"counters moved: {json.dumps(row['step_counters_moved']) or 'none'}; outputs "
            f"identical {row['outputs_identical']}/{row['outputs_compared']}; ITL p99 "
            f"{row['itl_p99_ms_without']} -> {row['itl_p99_ms_with']} ms ({ratio}x; p50 "
            f"{row['itl_p50_ms_without']} -> {row['itl_p50_ms_with']}); server errors "
            f"{row['server_errors']}",
            f"all refused, 0 dropped/recomputed, outputs identical, ITL p99 <= "
            f"{TARGET_RATIO}x", met)


def _ms(seconds: float | None) -> float | None:
    """Milliseconds, or None for no figure (a percentile of nothing is NaN)."""
    return None if seconds is None or seconds != seconds else round(seconds * 1000, 1)

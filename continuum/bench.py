"""``continuum bench``: a load generator for a running server, over gRPC or the OpenAI API.

Requests are built from token ids (exact prompt lengths, no tokenizer needed on the
client: ids are drawn from 1000..19999, valid for any Llama-family vocabulary), greedy
with ``ignore_eos`` so every request produces exactly its output length unless cancelled.

Arrivals: Poisson at ``--request-rate`` (``--burstiness`` B ≠ 1 draws gamma gaps with
shape 1/B: bursty above 1), all at once (``inf``), capped by ``--max-concurrency``; or
replayed from a trace's arrival times (``--dataset replay``). Workloads: fixed lengths;
lengths sampled from the Azure conversation trace (``--dataset azure``) scaled by
``--length-scale`` (the report says so); long-prompt bursts (``--long-prompt-fraction``);
a shared system prompt (``--shared-prefix-len``); a fraction cancelled mid-stream
(``--cancel-fraction``); several tenants and tiers (``--tenants a:3,b:1 --tiers 0:1,1:4``).

Metrics use ``vllm bench serve``'s definitions (see ``sim/metrics.py``): TTFT, TPOT =
(E2E − TTFT) ÷ (output tokens − 1), ITL between streamed chunks, E2E; mean, median, p90,
p99; request and token throughput; goodput under ``--goodput ttft:MS tpot:MS`` — overall
and per tier and tenant. ``--output`` writes JSON; ``--sweep-rates`` runs several rates
and ``--plot`` draws latency percentiles against offered load.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import math
import pathlib
import random
import sys
import time
from collections.abc import Sequence

from gateway.metrics import TIER_NAMES

TOKEN_ID_RANGE = (1000, 20000)
DEFAULT_TRACE = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data" / \
    "traces" / "azure_conv_2023.csv"


class BenchError(Exception):
    """A setting or input the user must fix; printed as one line, exit code 2."""


@dataclasses.dataclass
class Spec:
    """One request to send."""

    index: int
    arrival_s: float  # offset from the start of the run (ignored in concurrency mode)
    prompt_ids: list[int]
    max_tokens: int
    tenant: str = "default"
    tier: int = 1
    cancel_after: int | None = None  # cancel once this many tokens arrived


@dataclasses.dataclass
class Outcome:
    """What happened to one request; times are seconds from the start of the run."""

    index: int
    tenant: str
    tier: int
    prompt_tokens: int
    max_tokens: int
    sent_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    status: str = "ok"  # ok | cancelled | error code (RESOURCE_EXHAUSTED, HTTP_429, ...)
    detail: str = ""

    @property
    def completed(self) -> bool:
        return self.status == "ok" and self.finish_s is not None


# --- workloads ---------------------------------------------------------------------------


def _weights(spec: str, flag: str, cast=str) -> list[tuple[object, float]]:
    """Parses "a:3,b:1" into [(a, 3.0), (b, 1.0)]."""
    pairs = []
    for item in spec.split(","):
        name, _, weight = item.strip().partition(":")
        try:
            value = cast(name)
            share = float(weight or 1)
        except ValueError as exc:
            raise BenchError(f"{flag} {spec!r}: expected NAME:WEIGHT,... ({exc})") from exc
        if share <= 0 or not math.isfinite(share):
            raise BenchError(f"{flag} {spec!r}: weights must be > 0")
        pairs.append((value, share))
    return pairs


def read_trace(path: pathlib.Path) -> list[tuple[float, int, int]]:
    """(arrived_at, prompt tokens, output tokens) rows of an Azure-style trace CSV."""
    try:
        with path.open(newline="") as handle:
            rows = [(float(r["arrived_at"]), int(r["num_prefill_tokens"]),
                     int(r["num_decode_tokens"])) for r in csv.DictReader(handle)]
    except FileNotFoundError as exc:
        raise BenchError(f"--trace {path}: no such file") from exc
    except (KeyError, ValueError) as exc:
        raise BenchError(f"--trace {path}: expected columns arrived_at, num_prefill_tokens, "
                         f"num_decode_tokens ({exc})") from exc
    if not rows:
        raise BenchError(f"--trace {path} has no rows")
    return rows


def _gaps(rng: random.Random, n: int, rate: float, burstiness: float) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    shape = 1.0 / burstiness
    return [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(n)]


def build_workload(args: argparse.Namespace, rate: float) -> list[Spec]:
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.dataset == "fixed":
        lengths = [(args.input_len, args.output_len)] * n
        arrivals = None
    else:
        rows = read_trace(args.trace)
        if args.dataset == "replay":
            rows = rows[:n]
            start = rows[0][0]
            arrivals = [(r[0] - start) * args.time_scale for r in rows]
        else:
            rows = [rng.choice(rows) for _ in range(n)]
            arrivals = None
        lengths = [(r[1], r[2]) for r in rows]
        scale = args.length_scale
        lengths = [(max(1, min(args.max_input_len, round(p * scale))),
                    max(1, min(args.max_output_len, round(o * scale)))) for p, o in lengths]
    if arrivals is None:
        total, arrivals = 0.0, []
        for gap in _gaps(rng, n, rate, args.burstiness):
            arrivals.append(total)
            total += gap
    tenants = _weights(args.tenants, "--tenants")
    tiers = _weights(args.tiers, "--tiers", int)
    if any(t not in (0, 1, 2) for t, _ in tiers):
        raise BenchError("--tiers: tiers are 0 (premium), 1 (standard), 2 (best effort)")
    prefix = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(args.shared_prefix_len)]
    specs = []
    for i, ((prompt_len, output_len), arrival) in enumerate(zip(lengths, arrivals, strict=True)):
        if args.long_prompt_fraction and rng.random() < args.long_prompt_fraction:
            prompt_len = args.long_prompt_len
        body = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(max(1, prompt_len - len(prefix)))]
        cancel = None
        if args.cancel_fraction and rng.random() < args.cancel_fraction and output_len > 1:
            cancel = rng.randint(1, output_len - 1)
        specs.append(Spec(
            index=i, arrival_s=arrival, prompt_ids=prefix + body, max_tokens=output_len,
            tenant=rng.choices([t for t, _ in tenants], [w for _, w in tenants])[0],
            tier=rng.choices([t for t, _ in tiers], [w for _, w in tiers])[0],
            cancel_after=cancel,
        ))
    return specs


# --- clients -----------------------------------------------------------------------------


class GrpcClient:
    def __init__(self, addr: str, api_key: str | None):
        import grpc

        from protos.continuum.v1 import generation_pb2, generation_pb2_grpc

        self._grpc = grpc
        self._pb = generation_pb2
        self._channel = grpc.aio.insecure_channel(addr)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._priorities = (generation_pb2.PRIORITY_PREMIUM, generation_pb2.PRIORITY_STANDARD,
                            generation_pb2.PRIORITY_BEST_EFFORT)

    async def run(self, spec: Spec, outcome: Outcome, clock) -> None:
        request = self._pb.GenerateRequest(
            max_tokens=spec.max_tokens, tenant=spec.tenant, priority=self._priorities[spec.tier],
            sampling={"temperature": 0.0, "ignore_eos": True})
        request.token_ids.ids.extend(spec.prompt_ids)
        call = self._stub.Generate(request, metadata=self._metadata, timeout=3600)
        try:
            async for response in call:
                if response.token_ids:
                    outcome.output_tokens += len(response.token_ids)
                    _on_chunk(outcome, clock())
                if spec.cancel_after is not None and outcome.output_tokens >= spec.cancel_after:
                    call.cancel()
                    outcome.status = "cancelled"
                    return
            outcome.finish_s = clock()
        except self._grpc.aio.AioRpcError as exc:
            outcome.status, outcome.detail = exc.code().name, exc.details() or ""

    async def close(self) -> None:
        await self._channel.close()


class OpenAIClient:
    """Streams /v1/completions with token-id prompts over SSE (aiohttp, one session)."""

    def __init__(self, base_url: str, api_key: str | None):
        import aiohttp

        self._aiohttp = aiohttp
        self._url = base_url.rstrip("/") + "/completions"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=3600),
            connector=aiohttp.TCPConnector(limit=0))

    async def run(self, spec: Spec, outcome: Outcome, clock) -> None:
        body = {"prompt": spec.prompt_ids, "max_tokens": spec.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "tenant": spec.tenant, "priority": TIER_NAMES[spec.tier]}
        try:
            async with self._session.post(self._url, json=body) as response:
                if response.status != 200:
                    outcome.status = f"HTTP_{response.status}"
                    outcome.detail = (await response.text())[:200]
                    return
                chunks = 0
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        outcome.status, outcome.detail = "STREAM_ERROR", event["error"]["message"]
                        return
                    if event.get("usage"):
                        outcome.output_tokens = event["usage"]["completion_tokens"]
                    elif event["choices"] and event["choices"][0]["text"]:
                        chunks += 1  # one streamed message per token (held-back text merges)
                        outcome.output_tokens = chunks
                        _on_chunk(outcome, clock())
                        if spec.cancel_after is not None and chunks >= spec.cancel_after:
                            outcome.status = "cancelled"
                            return  # leaving the block closes the connection
                outcome.finish_s = clock()
        except self._aiohttp.ClientError as exc:
            outcome.status, outcome.detail = "CONNECTION", str(exc)

    async def close(self) -> None:
        await self._session.close()


def _on_chunk(outcome: Outcome, now: float) -> None:
    if outcome.first_token_s is None:
        outcome.first_token_s = now
    outcome.chunk_times.append(now)


# --- running -----------------------------------------------------------------------------


async def run_workload(client, specs: Sequence[Spec], max_concurrency: int | None,
                       progress: bool = True) -> tuple[list[Outcome], float]:
    """Sends every spec at its arrival time (or as slots free up); returns outcomes, wall s."""
    from tqdm import tqdm

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), unit="req", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    started = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - started

    async def one(spec: Spec) -> Outcome:
        delay = spec.arrival_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is not None:
            await limit.acquire()
        outcome = Outcome(spec.index, spec.tenant, spec.tier, len(spec.prompt_ids),
                          spec.max_tokens, sent_s=clock())
        try:
            await client.run(spec, outcome, clock)
        finally:
            if limit is not None:
                limit.release()
            bar.update(1)
        return outcome

    try:
        outcomes = await asyncio.gather(*(one(s) for s in specs))
    finally:
        bar.close()
    return list(outcomes), clock()


# --- reporting -------------------------------------------------------------------------


def summarize_outcomes(outcomes: Sequence[Outcome], duration_s: float,
                       slos: dict[str, float]) -> dict:
    """Overall, per tier and per tenant summaries (sim.metrics definitions; SLOs in ms)."""
    from sim.metrics import summarize

    def group(items: Sequence[Outcome]) -> dict:
        timings = [(o.sent_s, o.first_token_s, o.finish_s, o.output_tokens, o.chunk_times)
                   for o in items if o.completed and o.first_token_s is not None]
        result = summarize(timings, duration_s, slo_ttft_ms=slos.get("ttft"),
                           slo_tpot_ms=slos.get("tpot"), slo_e2e_ms=slos.get("e2e"))
        result["num_requests"] = len(items)
        result["num_completed"] = len(timings)
        result["num_cancelled"] = sum(o.status == "cancelled" for o in items)
        errors: dict[str, int] = {}
        for o in items:
            if o.status not in ("ok", "cancelled"):
                errors[o.status] = errors.get(o.status, 0) + 1
        result["errors"] = errors
        return result

    report = {"duration_s": duration_s, "overall": group(outcomes), "by_tier": {},
              "by_tenant": {}}
    for tier in sorted({o.tier for o in outcomes}):
        report["by_tier"][TIER_NAMES[tier]] = group([o for o in outcomes if o.tier == tier])
    for tenant in sorted({o.tenant for o in outcomes}):
        report["by_tenant"][tenant] = group([o for o in outcomes if o.tenant == tenant])
    return report


def _ms(value) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.0f}"


def format_report(report: dict, title: str) -> str:
    lines = [title]
    header = (f"{'group':<16}{'done':>6}{'cancel':>7}{'err':>5}{'req/s':>7}{'out tok/s':>10}"
              f"{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}{'p99':>7}{'ITL p99':>8}"
              f"{'E2E p50':>8}{'goodput':>8}")
    lines.append(header + "   (latencies in ms)")

    def row(name: str, s: dict) -> str:
        get = s.get
        return (f"{name:<16}{s['num_completed']:>6}{s['num_cancelled']:>7}"
                f"{sum(s['errors'].values()):>5}{get('request_throughput', 0):>7.2f}"
                f"{get('output_throughput', 0):>10.1f}{_ms(get('ttft_median_ms')):>9}"
                f"{_ms(get('ttft_p99_ms')):>7}{_ms(get('tpot_median_ms')):>9}"
                f"{_ms(get('tpot_p99_ms')):>7}{_ms(get('itl_p99_ms')):>8}"
                f"{_ms(get('e2e_median_ms')):>8}"
                f"{get('goodput', 0):>8.2f}")

    lines.append(row("overall", report["overall"]))
    for name, s in report["by_tier"].items():
        lines.append(row(f"tier {name}", s))
    for name, s in report["by_tenant"].items():
        lines.append(row(f"tenant {name}", s))
    errors = report["overall"]["errors"]
    if errors:
        lines.append("errors: " + ", ".join(f"{k} × {v}" for k, v in sorted(errors.items())))
    return "\n".join(lines)


def plot_sweep(points: list[tuple[float, dict]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r, _ in points]
    fig, (ttft, tpot, tput) = plt.subplots(1, 3, figsize=(15, 4.5))
    for key, style in (("median", "-o"), ("p90", "--s"), ("p99", ":^")):
        for axis, name in ((ttft, "ttft"), (tpot, "tpot")):
            axis.plot(rates, [p["overall"].get(f"{name}_{key}_ms", math.nan) for _, p in points],
                      style, label=key)
    tput.plot(rates, [p["overall"].get("output_throughput", 0) for _, p in points], "-o")
    ttft.set(title="TTFT vs offered load", xlabel="request rate (req/s)", ylabel="ms")
    tpot.set(title="TPOT vs offered load", xlabel="request rate (req/s)", ylabel="ms")
    tput.set(title="output tokens/s", xlabel="request rate (req/s)", ylabel="tokens/s")
    ttft.legend()
    tpot.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_slos(items: Sequence[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise BenchError(f"--goodput {item!r}: use ttft:MS, tpot:MS or e2e:MS")
        try:
            slos[name] = float(value)
        except ValueError as exc:
            raise BenchError(f"--goodput {item!r}: {value!r} is not a number of ms") from exc
    return slos


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc")
    p.add_argument("--addr", default="127.0.0.1:50051", help="gateway gRPC HOST:PORT")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI API base URL")
    p.add_argument("--api-key", default=None, help="API key, when the server requires one")
    p.add_argument("--dataset", choices=("fixed", "azure", "replay"), default="fixed")
    p.add_argument("--trace", type=pathlib.Path, default=DEFAULT_TRACE,
                   help="Azure-style CSV (arrived_at, num_prefill_tokens, num_decode_tokens)")
    p.add_argument("--length-scale", type=float, default=0.25,
                   help="multiply trace lengths by this (scale to the machine; reported)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="replay: multiply trace inter-arrival times by this")
    p.add_argument("--max-input-len", type=int, default=2048)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--input-len", type=int, default=128, help="fixed dataset prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="fixed dataset output tokens")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma arrivals: 1 = Poisson, >1 burstier, <1 smoother")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (fixed-concurrency load)")
    p.add_argument("--long-prompt-fraction", type=float, default=0.0)
    p.add_argument("--long-prompt-len", type=int, default=1024)
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens of system prompt every request shares")
    p.add_argument("--cancel-fraction", type=float, default=0.0,
                   help="share of requests cancelled mid-stream")
    p.add_argument("--tenants", default="default:1", help="NAME:WEIGHT,...")
    p.add_argument("--tiers", default="1:1", help="TIER:WEIGHT,... (0 premium .. 2 best effort)")
    p.add_argument("--goodput", nargs="*", default=[], metavar="SLO",
                   help="SLOs for goodput, e.g. ttft:500 tpot:150 (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-rates", default=None,
                   help="comma-separated request rates to run one after another")
    p.add_argument("--output", type=pathlib.Path, default=None, help="write results as JSON")
    p.add_argument("--plot", type=pathlib.Path, default=None,
                   help="with --sweep-rates: PNG of latency percentiles vs load")
    p.add_argument("--no-progress", action="store_true")


def validate_args(args: argparse.Namespace) -> None:
    problems = []
    if args.num_prompts < 1:
        problems.append("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        problems.append("--request-rate must be > 0 (inf for all at once)")
    if not args.burstiness > 0:
        problems.append("--burstiness must be > 0")
    for flag in ("long_prompt_fraction", "cancel_fraction"):
        if not 0 <= getattr(args, flag) <= 1:
            problems.append(f"--{flag.replace('_', '-')} must be in [0, 1]")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        problems.append("--max-concurrency must be >= 1")
    if min(args.input_len, args.output_len, args.long_prompt_len) < 1:
        problems.append("lengths must be >= 1")
    if args.shared_prefix_len < 0:
        problems.append("--shared-prefix-len must be >= 0")
    if args.plot and not args.sweep_rates:
        problems.append("--plot needs --sweep-rates")
    if problems:
        raise BenchError("; ".join(problems))


def _rates(args: argparse.Namespace) -> list[float]:
    if not args.sweep_rates:
        return [args.request_rate]
    try:
        rates = [float(r) for r in args.sweep_rates.split(",")]
    except ValueError as exc:
        raise BenchError(f"--sweep-rates {args.sweep_rates!r}: {exc}") from exc
    if any(not r > 0 for r in rates):
        raise BenchError("--sweep-rates: every rate must be > 0")
    return rates


async def bench(args: argparse.Namespace) -> list[tuple[float, dict]]:
    slos = _parse_slos(args.goodput)
    points = []
    for point, rate in enumerate(_rates(args)):
        # Fresh prompts per sweep point: the same ids would hit the prefix cache.
        specs = build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + point}),
                               rate)
        client = (OpenAIClient(args.base_url, args.api_key) if args.api == "openai"
                  else GrpcClient(args.addr, args.api_key))
        try:
            outcomes, duration = await run_workload(client, specs, args.max_concurrency,
                                                    progress=not args.no_progress)
        finally:
            await client.close()
        report = summarize_outcomes(outcomes, duration, slos)
        report["config"] = {
            "api": args.api, "dataset": args.dataset, "request_rate": rate,
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            "num_prompts": args.num_prompts, "length_scale": args.length_scale,
            "mean_prompt_tokens": sum(len(s.prompt_ids) for s in specs) / len(specs),
            "mean_output_tokens": sum(s.max_tokens for s in specs) / len(specs),
            "slos_ms": slos,
        }
        title = (f"rate {rate:g} req/s, {args.num_prompts} requests over {args.api} "
                 f"({args.dataset}, mean prompt {report['config']['mean_prompt_tokens']:.0f} / "
                 f"output {report['config']['mean_output_tokens']:.0f} tokens"
                 + (f", trace lengths × {args.length_scale:g}" if args.dataset != "fixed" else "")
                 + f"), {duration:.1f} s")
        print(format_report(report, title), flush=True)
        points.append((rate, report))
    return points


def main(args: argparse.Namespace) -> int:
    try:
        validate_args(args)
        points = asyncio.run(bench(args))
    except BenchError as exc:
        print(f"continuum bench: {exc}", file=sys.stderr)
        return 2
    if args.output:
        args.output.write_text(json.dumps([r for _, r in points], indent=2))
        print(f"results: {args.output}")
    if args.plot:
        plot_sweep(points, args.plot)
        print(f"plot: {args.plot}")
    return 0

"""The requests ``continuum bench`` sends: lengths, arrival times, tenants, tiers, cancels.

Deterministic in ``--seed``: the same flags build the same requests (token ids,
lengths, arrivals), so two runs, or two policies, can be compared request for
request. Token ids are drawn from 1000..19999, valid for any Llama-family
vocabulary, so no tokenizer is needed on the client and prompt lengths are exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random

from protos import tiers as tier_defs
from sim.data import TraceError, default_trace, read_trace

TOKEN_ID_RANGE = (1000, 20000)


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


def _gaps(rng: random.Random, n: int, rate: float, burstiness: float) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    shape = 1.0 / burstiness
    return [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(n)]


def _trace_mix(args: argparse.Namespace, rng: random.Random, n: int):
    """(lengths, arrivals or None) from the trace: replayed in order, or sampled."""
    try:
        rows = read_trace(args.trace or default_trace())
    except TraceError as exc:
        raise BenchError(f"--trace {exc}") from exc
    if args.dataset == "replay":
        rows = rows[:n]
        start = rows[0][0]
        arrivals = [(r[0] - start) * args.time_scale for r in rows]
    else:
        rows = [rng.choice(rows) for _ in range(n)]
        arrivals = None
    scale = args.length_scale
    lengths = [(max(1, min(args.max_input_len, round(p * scale))),
                max(1, min(args.max_output_len, round(o * scale)))) for _, p, o in rows]
    return lengths, arrivals


def build_workload(args: argparse.Namespace, rate: float) -> list[Spec]:
    """The run's requests, from ``continuum bench``'s flags, at ``rate`` requests/s."""
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.dataset == "fixed":
        lengths, arrivals = [(args.input_len, args.output_len)] * n, None
    else:
        lengths, arrivals = _trace_mix(args, rng, n)
    if arrivals is None:
        total, arrivals = 0.0, []
        for gap in _gaps(rng, n, rate, args.burstiness):
            arrivals.append(total)
            total += gap
    tenants = _weights(args.tenants, "--tenants")
    tiers = _weights(args.tiers, "--tiers", int)
    if any(t not in range(tier_defs.NUM_TIERS) for t, _ in tiers):
        raise BenchError(f"--tiers: the tiers are {tier_defs.describe()}")
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

"""Plan fan-out at tensor parallelism: how long until every other rank holds rank 0's plan.

tp CPU processes join a real gloo group through executor_svc/tp_comm.py's TPComm (the ring
set up as the executor sets it up). For each plan size, rank 0 sends ``steps`` plans
through the shared-memory ring and ``steps`` through the gloo broadcast, alternating in
blocks of 10 so both see the same machine load. Each plan carries rank 0's clock
(CLOCK_MONOTONIC, shared by every process on the machine) in its first 8 bytes; a rank
notes the clock once it has the whole payload, and the fan-out of one plan is the latest
rank's delay. Between plans rank 0 waits ``gap_s``, as it would while a step computes.

    .venv/bin/python -m benchmarks.bench_channel --fanout --tp 2 4
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time
from types import SimpleNamespace

from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2
from sim.metrics import percentile

_BLOCK = 10  # plans per channel before switching to the other


def decode_plan(n: int) -> bytes:
    """A decode step of ``n`` running sequences as build_plan writes it: ids, one token
    each, a new block for every 16th sequence."""
    plan = pb.BatchPlan(incarnation="0" * 32, step_id=123_456)
    ids = range(10_000, 10_000 + n)
    plan.cached_seq_ids.extend(ids)
    plan.cached_num_scheduled_tokens.extend([1] * n)
    plan.cached_num_new_blocks.extend(int(i % 16 == 0) for i in ids)
    plan.cached_new_block_ids.extend(50_000 + i for i in ids if i % 16 == 0)
    return plan.SerializeToString()


def prefill_plan(tokens: int) -> bytes:
    """A new sequence's first chunk: ``tokens`` prompt ids (a --max-num-batched-tokens
    chunk) and their blocks."""
    plan = pb.BatchPlan(incarnation="0" * 32, step_id=123_456)
    plan.new_seqs.add(seq_id=7, token_ids=[(i * 7919) % 49_152 for i in range(tokens)],
                      num_scheduled_tokens=tokens, block_ids=range(1000, 1000 + tokens // 16),
                      num_prompt_tokens=tokens,
                      sampling=sampling_pb2.SamplingParams(temperature=0.7, top_p=0.9))
    return plan.SerializeToString()


def sizes() -> list[tuple[str, bytes]]:
    return [("decode 1", decode_plan(1)), ("decode 64", decode_plan(64)),
            ("decode 256", decode_plan(256)), ("prefill 2048", prefill_plan(2048))]


def _schedule(steps: int) -> list[tuple[int, str]]:
    """(size index, channel) for every plan, in order: both ends follow the same list."""
    out = []
    for i in range(len(sizes())):
        for start in range(0, steps, _BLOCK):
            for channel in ("shm", "gloo"):
                out += [(i, channel)] * min(_BLOCK, steps - start)
    return out


def _rank(rank: int, tp: int, init: str, steps: int, gap_s: float, results) -> None:
    import torch

    from executor_svc.tp_comm import Command, TPComm

    torch.set_num_threads(1)
    comm = TPComm(SimpleNamespace(rank=rank, tp_size=tp))
    comm.connect(init, timeout_s=120, device="cpu")
    ring = comm._writer if rank == 0 else comm._reader
    assert ring is not None, "no shared-memory ring on this machine"
    payloads = [p for _, p in sizes()]
    delays = []
    for i, channel in _schedule(steps):
        if rank == 0:
            time.sleep(gap_s)
            stamp = time.perf_counter_ns().to_bytes(8, "little")
            body = stamp + payloads[i][8:]
            if channel == "shm":
                comm.send_command(Command.PLAN, body)
            else:
                comm._gloo_send(Command.PLAN, body)
            continue
        _, body = comm.receive_command() if channel == "shm" else comm._gloo_receive()
        got = time.perf_counter_ns()
        delays.append(got - int.from_bytes(body[:8], "little"))
        assert len(body) == len(payloads[i])
    if rank == 0:
        comm.send_command(Command.STOP)
    else:
        assert comm.receive_command()[0] == Command.STOP
        results.put((rank, delays))
    comm.close()


def fanout(tp: int, steps: int, gap_s: float) -> dict[tuple[str, str], tuple[float, float]]:
    """{(size, channel): (p50 µs, p99 µs)} over real processes."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="continuum-bench-") as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_rank, args=(r, tp, init, steps, gap_s, results))
                 for r in range(tp)]
        for p in procs:
            p.start()
        per_rank = dict(results.get(timeout=600) for _ in range(tp - 1))
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"a rank exited {p.exitcode}"
    schedule = _schedule(steps)
    worst = [max(d[k] for d in per_rank.values()) for k in range(len(schedule))]
    by: dict[tuple[str, str], list[float]] = {}
    names = [name for name, _ in sizes()]
    for (i, channel), ns in zip(schedule, worst, strict=True):
        by.setdefault((names[i], channel), []).append(ns / 1e3)
    return {k: (statistics.median(v), percentile(v, 99)) for k, v in by.items()}


def run_fanout(tps: list[int], steps: int, gap_s: float) -> None:
    plan_bytes = {name: len(p) for name, p in sizes()}
    print(f"{'tp':>3} {'plan':>13} {'bytes':>7} {'ring p50':>9} {'ring p99':>9} "
          f"{'gloo p50':>9} {'gloo p99':>9}   (µs until the last rank has it)")
    for tp in tps:
        stats = fanout(tp, steps, gap_s)
        for name, size in plan_bytes.items():
            r50, r99 = stats[(name, "shm")]
            g50, g99 = stats[(name, "gloo")]
            print(f"{tp:>3} {name:>13} {size:>7} {r50:>9.0f} {r99:>9.0f} {g50:>9.0f} "
                  f"{g99:>9.0f}")

"""Per-step cost of the scheduler ⇄ executor channel, and of the plan's fan-out to the
tensor-parallel ranks, excluding compute.

Round trip: a real ZeroMQ ROUTER/DEALER pair over ipc:// in two processes: the scheduler
side builds a decode plan for N running sequences (core + build_plan), encodes and sends
it; an echo executor decodes it, builds a StepResult with one token per sequence, encodes
and sends it back; the scheduler decodes it and applies it (update). Prints the median
round trip in microseconds.

Fan-out (``--fanout``, benchmarks/bench_fanout.py): rank 0 hands real serialized plans to
tp - 1 other ranks (CPU processes) through TPComm's two command channels, the
shared-memory ring and the gloo broadcast, alternating, and prints p50/p99 of the time
until the last rank has the plan.

    .venv/bin/python -m benchmarks.bench_channel [--fanout [--tp 2 4]]
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time

import zmq

from benchmarks.bench_scheduler import make_scheduler
from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import Request
from scheduler_svc.plan import build_plan


def echo_executor(address: str) -> None:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"ready")
    while True:
        frame = sock.recv()
        if frame == b"stop":
            return
        _, plan = wire.decode_from_scheduler(frame)
        ids = list(plan.cached_seq_ids) + [s.seq_id for s in plan.new_seqs]
        result = pb.StepResult(incarnation=plan.incarnation, step_id=plan.step_id,
                               seq_ids=ids, token_ids=[7] * len(ids))
        sock.send(wire.encode_to_scheduler("result", result))


def running_decodes(n: int):
    sched = make_scheduler(n)
    for i in range(n):
        sched.add_request(Request(f"r{i}", i + 1, list(range(100, 140)), 40,
                                  max_tokens=100_000, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, [r.seq_id for r, _ in out.new], [7] * len(out.new))
    return sched


def measure(sock, peer: bytes, n: int, steps: int = 300) -> float:
    sched = running_decodes(n)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sock.send_multipart([peer, wire.encode_to_executor(
            "plan", build_plan(out, "inc", sched.block_manager))])
        _, frame = sock.recv_multipart()
        _, result = wire.decode_from_executor(frame)
        sched.update(out, result.seq_ids, result.token_ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fanout", action="store_true",
                        help="plan fan-out to tp ranks: shared-memory ring vs gloo broadcast")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=200, help="plans per size and channel")
    parser.add_argument("--gap-ms", type=float, default=2.0,
                        help="pause between plans (a step's compute, during which ranks wait)")
    args = parser.parse_args(argv)
    if args.fanout:
        from benchmarks.bench_fanout import run_fanout

        run_fanout(args.tp, args.steps, args.gap_ms / 1e3)
        return
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/bench.sock"
        sock = zmq.Context().socket(zmq.ROUTER)
        sock.bind(address)
        child = multiprocessing.get_context("spawn").Process(target=echo_executor,
                                                              args=(address,))
        child.start()
        peer, _ = sock.recv_multipart()
        print(f"{'running decodes':>15} {'round trip µs (p50)':>20}")
        for n in (64, 256):
            print(f"{n:>15} {measure(sock, peer, n):>20.0f}")
        sock.send_multipart([peer, b"stop"])
        child.join()


if __name__ == "__main__":
    main()

"""Per-step cost of the scheduler ⇄ executor channel, and of the plan's fan-out to the
tensor-parallel ranks, excluding compute.

Round trip: a real ZeroMQ ROUTER/DEALER pair over ipc:// in two processes: the scheduler
side builds a decode plan for N running sequences (core + build_plan), encodes and sends
it; an echo executor decodes it, builds a StepResult with one token per sequence, encodes
and sends it back; the scheduler decodes it and applies it (update). Two transports for
the plan, each with its own echo process, alternating in blocks of ``--block`` plans so
both see the same machine phases: ``zmq`` (the plan over ZeroMQ) and ``shm`` (the plan
written into the shared-memory ring by the scheduler's own PlanChannel, read in place by
the executor's own PlanRingReader, spinning after each plan as executor_svc/link.py does
where the host has a core to spare (plan_ring.spin_budget), a RingBell over ZeroMQ when it
sleeps). The result comes back over ZeroMQ in both. Prints
the median round trip in microseconds (and p90).

Fan-out (``--fanout``, benchmarks/bench_fanout.py): rank 0 hands real serialized plans to
tp - 1 other ranks (CPU processes) through TPComm's two command channels, the
shared-memory ring and the gloo broadcast, alternating, and prints p50/p99 of the time
until the last rank has the plan.

    .venv/bin/python -m benchmarks.bench_channel [--sizes 64 256 1024] [--fanout [--tp 2 4]]
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time

import zmq

from benchmarks.scheduler_steps import make_scheduler
from protos import seq_columns, wire
from protos.continuum.v1 import executor_pb2 as pb
from runtime import plan_ring
from scheduler_svc.core import Request
from scheduler_svc.plan import build_plan
from scheduler_svc.plan_channel import PlanChannel


def echo_executor(address: str) -> None:
    """Answers each plan with one token per sequence. A heartbeat offering a ring attaches
    it: from then on plans come through the ring as under executor_svc/link.py."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"ready")
    ring: plan_ring.PlanRingReader | None = None
    spin, spin_s = False, plan_ring.spin_budget()
    while True:
        frame = None
        if ring is not None:
            frame = ring.wait(spin_s if spin else 0.0, lambda: bool(sock.poll(0)))
        if frame is None:
            frame = sock.recv()
            if ring is not None:
                ring.awake()
                if frame == wire.RING_BELL:  # the plan is in the ring
                    spin = False
                    continue
        if frame == b"stop":
            return
        kind, msg = wire.decode_from_scheduler(frame)
        spin = kind == "plan"
        if kind == "heartbeat":  # the offer
            offer = msg.plan_ring
            ring = plan_ring.PlanRingReader(offer.name, offer.generation, offer.key, None, "inc")
            sock.send(wire.encode_to_scheduler("heartbeat", pb.Heartbeat(
                incarnation="inc", plan_ring_name=offer.name)))
        elif kind == "plan":
            ids = [s.seq_id for s in msg.new_seqs] + wire.plan_cached_seq_ids(msg)
            result = pb.StepResult(incarnation=msg.incarnation, step_id=msg.step_id,
                                   packed_seq_ids=seq_columns.pack(ids),
                                   token_ids=[7] * len(ids))  # as executor_svc answers
            sock.send(wire.encode_to_scheduler("result", result))


def running_decodes(n: int):
    sched = make_scheduler(n)
    for i in range(n):
        sched.add_request(Request(f"r{i}", i + 1, list(range(100, 140)), 40,
                                  max_tokens=100_000, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, [r.seq_id for r, _ in out.new], [7] * len(out.new))
    return sched


class Executor:
    """One echo executor process and, for ``shm``, the PlanChannel its plans go through."""

    def __init__(self, tmp: str, transport: str) -> None:
        address = f"ipc://{tmp}/{transport}.sock"
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(address)
        self.child = multiprocessing.get_context("spawn").Process(target=echo_executor,
                                                                   args=(address,))
        self.child.start()
        self.peer, _ = self.sock.recv_multipart()
        self.channel = PlanChannel(transport, address, None)
        self.channel.renew("inc")
        offer = self.channel.offer()
        if offer is not None:
            hb = pb.Heartbeat(incarnation="inc", plan_ring=offer)
            self.sock.send_multipart([self.peer, wire.encode_to_executor("heartbeat", hb)])
            _, frame = self.sock.recv_multipart()
            self.channel.confirm(wire.decode_from_executor(frame)[1].plan_ring_name)
            assert self.channel.confirmed

    def send_plan(self, frame: bytes) -> None:
        """As scheduler_svc/link.py's send_plan."""
        in_ring = self.channel.write(frame)
        if in_ring is None:
            self.sock.send_multipart([self.peer, frame])
        elif in_ring:
            self.sock.send_multipart([self.peer, wire.RING_BELL])

    def close(self) -> None:
        self.sock.send_multipart([self.peer, b"stop"])
        self.child.join()
        self.channel.close()
        self.sock.close()


def measure(executor: Executor, sched, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        executor.send_plan(wire.encode_to_executor(
            "plan", build_plan(out, "inc", sched.block_manager)))
        _, frame = executor.sock.recv_multipart()
        _, result = wire.decode_from_executor(frame)
        sched.update(out, *wire.result_columns(result))
        times.append(time.perf_counter() - t0)
    return times


def round_trips(sizes: list[int], steps: int, block: int) -> None:
    transports = ("zmq", "shm")
    print(f"{'running decodes':>15} {'zmq p50 µs':>11} {'shm p50 µs':>11} {'shm/zmq':>8} "
          f"{'zmq p90':>8} {'shm p90':>8} {'plans in ring':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        executors = {t: Executor(tmp, t) for t in transports}
        try:
            for n in sizes:
                scheds = {t: running_decodes(n) for t in transports}
                for t in transports:
                    measure(executors[t], scheds[t], 20)  # warm
                times = {t: [] for t in transports}
                for _ in range(max(1, steps // block)):
                    for t in transports:
                        times[t] += measure(executors[t], scheds[t], block)
                p50 = {t: statistics.median(v) * 1e6 for t, v in times.items()}
                p90 = {t: sorted(v)[int(0.9 * len(v))] * 1e6 for t, v in times.items()}
                ring = executors["shm"].channel
                print(f"{n:>15} {p50['zmq']:>11.0f} {p50['shm']:>11.0f} "
                      f"{p50['shm'] / p50['zmq']:>8.2f} {p90['zmq']:>8.0f} {p90['shm']:>8.0f} "
                      f"{ring.num_ring_plans:>6}/{ring.num_ring_plans + ring.num_zmq_plans}")
        finally:
            for executor in executors.values():
                executor.close()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fanout", action="store_true",
                        help="plan fan-out to tp ranks: shared-memory ring vs gloo broadcast")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=0,
                        help="plans per size and channel (default: 600; 200 with --fanout)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024],
                        help="running decodes per plan")
    parser.add_argument("--block", type=int, default=50,
                        help="plans in a row on one transport before switching")
    parser.add_argument("--gap-ms", type=float, default=2.0,
                        help="pause between plans (a step's compute, during which ranks wait)")
    args = parser.parse_args(argv)
    if args.fanout:
        from benchmarks.bench_fanout import run_fanout

        run_fanout(args.tp, args.steps or 200, args.gap_ms / 1e3)
        return
    round_trips(args.sizes, args.steps or 600, args.block)


if __name__ == "__main__":
    main()

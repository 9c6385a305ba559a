"""Per-step cost of the scheduler ⇄ executor channel, excluding compute: a decode plan for
N running sequences built, sent to an echo executor process over ipc:// and its result
applied, with the plan over ZeroMQ (``zmq``) or the shared-memory ring (``shm``, spinning
as executor_svc/link.py does), alternating in blocks of ``--block`` plans. Prints the round
trip's p50 and p90 in µs (docs/benchmarks.md, docs/gpu.md).

    .venv/bin/python -m benchmarks.bench_channel [--sizes 64 256 1024]
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
from sim.metrics import percentile


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
                p90 = {t: percentile(v, 90) * 1e6 for t, v in times.items()}
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
    parser.add_argument("--steps", type=int, default=600, help="plans per size and channel")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024],
                        help="running decodes per plan")
    parser.add_argument("--block", type=int, default=50,
                        help="plans in a row on one transport before switching")
    args = parser.parse_args(argv)
    round_trips(args.sizes, args.steps, args.block)


if __name__ == "__main__":
    main()

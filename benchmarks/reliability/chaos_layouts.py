"""The chaos matrix's processes: which replicas and gateways each row needs.

* replica ``a`` (roomy pool) behind gateway ``g``: executor kill -9 / SIGSTOP during
  prefill (long prompts, faulted while their first step runs) and during decode;
* replica ``tight`` (a pool too small for the batch, a host swap pool) behind ``gt``:
  the same two faults once the scheduler has preempted (swap is chosen when copying the
  KV costs less than re-prefilling it, which holds for these prompt lengths);
* gateway ``g2`` over replicas ``a`` and ``b``: scheduler kill -9 (then ``a`` is
  replaced on its port) and SIGSTOP of one replica;
* gateways ``g`` and ``gk`` on replica ``b``: kill -9 of ``gk``; ``g``'s streams must not
  notice, ``gk``'s end (``ended``), and replica ``b`` frees their blocks.

Each replica's executor is supervised like serve's (servers.Replica). After every row the
involved replicas must go idle with every block free (``blocks_free_after``).
"""

from __future__ import annotations

import contextlib
import pathlib
import signal

from benchmarks.reliability.chaos import (
    SIZES,
    Fault,
    _cont,
    _signal,
    executor_faults,
    in_decode,
    in_prefill,
    reference,
    requests,
    run_fault,
)
from harness import servers

BLOCK_BYTES = 16 * 46080  # SmolLM2-135M, float32 KV, 16-token blocks
ROOMY = ("--kv-cache-bytes", str(256 << 20))
# Every short stream is admitted (about 3 prompt blocks each), then their outputs outgrow
# the pool: running decodes need slots, so the scheduler preempts (as in
# tests/integration/test_preemption.py), and with a host pool it swaps.
TIGHT = ("--kv-cache-bytes", str(20 * BLOCK_BYTES), "--swap-space-bytes", str(64 << 20))


def _idle_clean(*replicas: servers.Replica) -> bool:
    for r in replicas:
        try:
            s = servers.wait_idle(r.port, 60)
        except Exception:
            return False
        if not (s.num_running == 0 and s.num_waiting == 0
                and s.num_free_blocks == s.num_total_blocks):
            return False
    return True


def _start_all(tmp: pathlib.Path) -> dict[str, servers.Replica]:
    """All three at once (they load the model in parallel), from this thread."""
    specs = {"a": ((), ROOMY), "b": ((), ROOMY), "tight": (("--max-num-seqs", "8"), TIGHT)}
    launched = {n: servers.launch_replica(tmp / n, s, e) for n, (s, e) in specs.items()}
    try:
        return {n: servers.ready(r) for n, r in launched.items()}
    except servers.ServerError:
        for r in launched.values():
            r.close()
        raise


def run_matrix(tmp: pathlib.Path, size: str = "default") -> list[dict]:
    """The whole matrix at ``size`` (chaos.SIZES), on processes it starts itself. It lives
    here, not in chaos.py, so that this module imports chaos and not the other way round."""
    return matrix(tmp, SIZES[size])


def matrix(tmp: pathlib.Path, cfg: dict) -> list[dict]:
    replicas = _start_all(tmp)
    a, b, tight = replicas["a"], replicas["b"], replicas["tight"]
    gateways: list[servers.Gateway] = []
    rows: list[dict] = []
    hang = cfg["hang_s"]
    try:
        g, gt = servers.start_gateway([a.port]), servers.start_gateway([tight.port])
        gateways += [g, gt]
        short = requests(cfg["streams"], cfg["max_tokens"])
        long = requests(cfg["streams"], cfg["max_tokens"], long_prompts=True)
        ref, long_ref = reference([g.addr], short), reference([g.addr], long)

        def executor_of(r: servers.Replica):
            return lambda: r.executor.pid

        for fault in executor_faults(executor_of(a), a.stats, "prefill", in_prefill):
            rows.append(_row(lambda f=fault: run_fault([g.addr], long, long_ref, f, hang), a))
        for fault in executor_faults(executor_of(a), a.stats, "decode", in_decode):
            rows.append(_row(lambda f=fault: run_fault([g.addr], short, ref, f, hang), a))
        for fault in executor_faults(executor_of(tight), tight.stats, "swap", None):
            fault.ready = _preempted_since(_safe_preemptions(tight))  # this row's base
            rows.append(_row(lambda f=fault: run_fault([gt.addr], short, ref, f, hang), tight))

        g2 = servers.start_gateway([a.port, b.port])
        gateways.append(g2)
        kill = Fault("scheduler kill -9 (1 of 2)", "decode",
                     _signal(lambda: a.scheduler.pid, signal.SIGKILL), _holding, a.stats)
        rows.append(_row(lambda: run_fault([g2.addr], short, ref, kill, hang), b))
        a.close()
        a = replicas["a"] = servers.start_replica(tmp / "a2", (), ROOMY, port=a.port)
        stop = _signal(lambda: a.scheduler.pid, signal.SIGSTOP)
        hung = Fault("scheduler SIGSTOP (1 of 2)", "decode", stop, _holding, a.stats,
                     undo=_cont(stop))
        rows.append(_row(lambda: run_fault([g2.addr], short, ref, hung, hang), a, b))

        gk = servers.start_gateway([b.port])
        gateways.append(gk)
        gb = servers.start_gateway([b.port])
        gateways.append(gb)
        gone = Fault("gateway kill -9 (1 of 2)", "decode",
                     _signal(lambda: gk.proc.pid, signal.SIGKILL), in_decode, b.stats,
                     expect_end=lambda i: i % 2 == 0)
        rows.append(_row(lambda: run_fault([gk.addr, gb.addr], short, ref, gone, hang), b))
    finally:
        for gw in gateways:
            if gw.proc.poll() is None:
                gw.proc.kill()
            gw.proc.wait()
        for r in replicas.values():
            with contextlib.suppress(Exception):
                r.close()
    return rows


def _holding(outs, stats) -> bool:
    """Every stream decoding, and the replica about to be faulted holds some of them."""
    return in_decode(outs, stats) and stats.num_running > 0


def _row(run, *replicas: servers.Replica) -> dict:
    """Runs one row (``run()``), then adds the idle check and the executor restarts it
    caused (one per executor fault is the design; more means a restarted executor was
    declared lost again)."""
    before = sum(r.num_restarts for r in replicas)
    row = run()
    row["blocks_free_after"] = _idle_clean(*replicas)
    row["executor_restarts"] = sum(r.num_restarts for r in replicas) - before
    return row


def _safe_preemptions(r: servers.Replica) -> int:
    with contextlib.suppress(Exception):
        return r.stats().num_preemptions
    return 0


def _preempted_since(base: int):
    return lambda outs, stats: stats.num_preemptions > base

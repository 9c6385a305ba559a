"""Tensor parallelism: the head split, and ``--tp-size 2`` as real processes (gloo on the CPU)
against the tp 1 Runner on the same plans, plus what happens when a rank dies or hangs."""

from __future__ import annotations

import math
import os
import signal
import time
from types import SimpleNamespace

import pytest

from executor_svc.tp_shard import split_heads
from harness.mini_scheduler import MiniScheduler, make_runner
from kernels import make_backend
from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2
from tests.executor.test_process import FakeScheduler, start_executor

LOGPROB_ATOL = 1e-4  # fp32; measured: <= 7e-6 at tp 2-4 (partial sums, other order)
EXIT_RANK_LOST = 3


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4, 9])
def test_heads_split_by_group_and_every_query_head_finds_its_kv_head(tp_size):
    split = split_heads(num_heads=9, num_kv_heads=3, tp_size=tp_size)
    assert sorted(h for q, _ in split for h in q) == list(range(9))  # each on exactly one rank
    for q, kv in split:
        assert len(q) >= 1 and all(h // 3 in kv for h in q)
        assert len(kv) == len({h // 3 for h in q})  # no KV head a rank does not use
    if tp_size <= 3:  # no KV head stored twice
        assert sum(len(kv) for _, kv in split) == 3


def test_smollm2_over_2_ranks_and_refusing_more_ranks_than_query_heads():
    assert [(q, kv) for q, kv in split_heads(9, 3, 2)] == [(range(0, 3), range(0, 1)),
                                                            (range(3, 9), range(1, 3))]
    with pytest.raises(ValueError, match="without a query head"):
        split_heads(9, 3, 10)


def _start_tp2(model_dir, address: str, *extra: str):
    return start_executor("--model", str(model_dir), "--ipc", address, "--kv-cache-bytes", "8MiB",
                          "--swap-space-bytes", "2MiB", "--warmup-tokens", "8",
                          "--threads", "1", "--attention-backend", "torch", "--tp-size", "2",
                          *extra)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class _Remote:
    """What MiniScheduler needs of a Runner, answered by the executor process."""

    def __init__(self, scheduler: FakeScheduler, hello: pb.Hello) -> None:
        self.scheduler, self.hello = scheduler, hello
        self.kv = SimpleNamespace(spec=SimpleNamespace(block_size=hello.block_size),
                                  num_blocks=hello.num_device_blocks)

    def execute(self, plan: pb.BatchPlan) -> pb.StepResult:
        plan.incarnation = self.hello.incarnation
        self.scheduler.send("plan", plan)
        kind, result = self.scheduler.recv()
        assert kind == "result"
        return result


@pytest.fixture
def tp2(model_dir, tmp_path):
    address = f"ipc://{tmp_path}/tp.sock"
    scheduler = FakeScheduler(address)
    procs = []

    def start(*extra: str):
        proc = _start_tp2(model_dir, address, *extra)
        procs.append(proc)
        deadline = time.monotonic() + 120
        while not scheduler.sock.poll(200):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no hello"
        kind, hello = scheduler.recv()
        assert kind == "hello"
        return proc, hello

    yield scheduler, start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # EOF on stderr: the workers (which share it) are gone too
    scheduler.close()


def _drive(runner) -> tuple[dict, dict]:
    """Four sequences of different lengths in 8-token chunks (prefill chunks and decodes share
    steps), one asking for logprobs, one seeded-random; a swap out and back in midway."""
    mini = MiniScheduler(runner, chunk_size=8)
    greedy_lp = sampling_pb2.SamplingParams(temperature=0.0, logprobs=2)
    seeded = sampling_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    prompts = {1: list(range(100, 105)), 2: list(range(200, 221)), 3: list(range(300, 313)),
               4: list(range(400, 430))}
    for seq_id, prompt in prompts.items():
        mini.add(seq_id, prompt, max_new=6,
                 sampling={2: greedy_lp, 4: seeded}.get(seq_id))
    logprobs: dict[int, list[float]] = {2: []}
    for step in range(40):
        if all(seq.done for seq in mini.seqs.values()):
            break
        if step == 3:
            mini.swap_out(3)
        if step == 5:
            mini.swap_in(3)
        result = mini.step()
        for i, seq_id in enumerate(wire.result_seq_ids(result)):
            if seq_id == 2:
                logprobs[2].append(result.logprobs[i])
    assert all(seq.done for seq in mini.seqs.values())
    return {seq_id: mini.outputs(seq_id) for seq_id in prompts}, logprobs


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_tp2_tokens_equal_tp1_then_sigterm_stops_every_rank(tp2, model):
    scheduler, start = tp2
    proc, hello = start()
    # 2 of the 3 KV heads on the larger rank: 2 * 30 layers * 2 heads * 64 * 4 bytes * 16.
    assert (hello.tp_size, hello.block_bytes) == (2, 491520)
    assert hello.num_device_blocks == (8 << 20) // 491520 and hello.num_host_blocks == 4
    [worker] = _children(proc.pid)
    remote = _Remote(scheduler, hello)
    # A plan past the command header's inline room (two broadcasts), and one every rank
    # refuses alike: the ranks must stay in step through both.
    big = pb.BatchPlan(step_id=100, finished_seq_ids=range(10**6, 10**6 + 2000))
    assert big.ByteSize() > 4096 and remote.execute(big).error_code == 0
    bad = _one_prefill(hello)
    bad.new_seqs[0].block_ids[0] = hello.num_device_blocks
    assert remote.execute(bad).error_code == pb.STEP_ERROR_CODE_BAD_BLOCK

    got, got_lp = _drive(remote)
    scheduler.send("heartbeat", pb.Heartbeat(incarnation=hello.incarnation))
    kind, beat = scheduler.recv()  # rank 0 answers heartbeats alone
    assert kind == "heartbeat" and beat.incarnation == hello.incarnation
    reference = make_runner(model, num_blocks=hello.num_device_blocks,
                            num_host_blocks=hello.num_host_blocks,
                            backend=make_backend("torch"))  # as the process (_start_tp2)
    want, want_lp = _drive(reference)
    assert got == want
    assert len(got_lp[2]) == 6 and all(not math.isnan(v) for v in got_lp[2])
    assert got_lp[2] == pytest.approx(want_lp[2], abs=LOGPROB_ATOL)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def _one_prefill(hello: pb.Hello) -> pb.BatchPlan:
    plan = pb.BatchPlan(incarnation=hello.incarnation, step_id=1)
    plan.new_seqs.add(seq_id=1, token_ids=[1, 2, 3], num_scheduled_tokens=3, block_ids=[0],
                      num_prompt_tokens=3, sampling=sampling_pb2.SamplingParams(temperature=0))
    return plan


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_killed_worker_mid_step_makes_rank0_exit_nonzero(tp2):
    scheduler, start = tp2
    proc, hello = start()
    [worker] = _children(proc.pid)
    os.kill(worker, signal.SIGSTOP)  # rank 0 will wait for it inside the step's collectives
    scheduler.send("plan", _one_prefill(hello))
    time.sleep(0.5)
    os.kill(worker, signal.SIGKILL)
    start_wait = time.monotonic()
    assert proc.wait(timeout=10) == EXIT_RANK_LOST
    assert time.monotonic() - start_wait < 5
    assert not _alive(worker) and not _children(proc.pid)


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_hung_worker_times_out_the_group(tp2):
    scheduler, start = tp2
    proc, hello = start("--tp-timeout-s", "3")
    [worker] = _children(proc.pid)
    os.kill(worker, signal.SIGSTOP)  # hung, not dead: only the collective's timeout can tell
    scheduler.send("plan", _one_prefill(hello))
    assert proc.wait(timeout=20) == EXIT_RANK_LOST
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)

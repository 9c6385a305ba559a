"""The operational guards: the prefill ceiling's alert and clamp, the
cap on concurrent swaps, and a request whose client vanished (killed, no cancel sent)
ending in a real scheduler process."""

# ruff: noqa: F811 (the scheduler fixtures are imported from scheduler_process)
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from protos.continuum.v1 import scheduler_pb2_grpc
from scheduler_svc.core import ConfigError, CostModel, SchedulerConfig
from tests.scheduler.factories import make_request, make_scheduler, run_to_completion, step
from tests.scheduler.scheduler_process import (  # noqa: F401 (fixtures)
    scheduler,
    scheduler_address,
)
from tests.scheduler.test_servicer import stats, wait_waiting

SWAP_COST = CostModel(prefill_tokens_per_s=10.0, swap_bytes_per_s=1e9, block_bytes=1000)


def test_the_prefill_clamp_bounds_every_step_and_decodes_keep_their_tokens():
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=128, chunk_size=128,
                           max_prefill_tokens_per_step=16, max_num_seqs=8)
    reqs = [make_request(60, 5) for _ in range(4)]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_completion(sched)
    assert max(o.num_prefill_tokens for o in outs) == 16
    assert all(r.is_finished and r.num_output_tokens == 5 for r in reqs)


def test_the_prefill_alert_counts_steps_past_the_ceiling():
    sched = make_scheduler(num_blocks=256, prefill_alert_tokens=24)
    sched.add_request(make_request(8, 2))
    run_to_completion(sched)
    assert sched.num_prefill_alerts == 0
    sched.add_request(make_request(40, 2))
    run_to_completion(sched)
    assert sched.num_prefill_alerts == 1


def test_swaps_beyond_the_cap_recompute_and_outputs_stay_the_same():
    def run(max_swapped):
        sched = make_scheduler(num_blocks=16, block_size=4, num_host_blocks=64,
                               cost=SWAP_COST, max_num_seqs=6, max_swapped=max_swapped,
                               enable_prefix_caching=False)
        reqs = [make_request(8, 16, request_id=f"s{i}") for i in range(6)]
        for r in reqs:
            sched.add_request(r)
        most = 0
        while sched.has_work():
            step(sched)
            most = max(most, sched.block_manager.num_swapped)
        return sched, {r.request_id: r.token_ids for r in reqs}, most

    free, tokens, most_free = run(0)
    assert most_free > 1, "the pool never swapped two at once: the test proves nothing"
    capped, capped_tokens, most_capped = run(1)
    assert most_capped == 1
    assert capped.lifecycle.num_swap_cap_fallbacks > 0
    assert capped.preemptions_by_reason.get("kv_full:recompute", 0) > 0
    assert capped_tokens == tokens


@pytest.mark.parametrize("field", ["prefill_alert_tokens", "max_prefill_tokens_per_step",
                                   "max_swapped"])
def test_a_negative_guard_is_refused_with_its_name(field):
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**{field: -1})


CLIENT = """
import sys, grpc
from protos.continuum.v1 import scheduler_pb2_grpc
from tests.conftest import TEST_METADATA
from tests.scheduler.submit_client import Stream
from tests.scheduler.test_servicer import submit_request
channel = grpc.insecure_channel(sys.argv[1])
stub = scheduler_pb2_grpc.SchedulerStub(channel)
stream = Stream(stub, submit_request("vanishing", max_tokens=8), timeout=600,
                metadata=TEST_METADATA)
print("submitted", flush=True)
for _ in stream:
    pass
"""


def test_a_request_whose_client_vanished_ends(scheduler, scheduler_address):
    """No cancel is sent: the client process is killed. The connection's end cancels the
    SubmitMany call on the scheduler's side (a peer that vanished without one is found by
    the keepalive pings of scheduler_svc/__main__.py), which aborts its open stream's
    request and frees what it held: the inactivity watchdog the seed asks for needs no
    code of its own."""
    stub = scheduler_pb2_grpc.SchedulerStub(scheduler)
    wait_waiting(stub, 0)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, scheduler_address],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "submitted"
        wait_waiting(stub, 1)  # no executor: it waits in the queue
    finally:
        client.kill()
        client.wait(timeout=30)
    deadline = time.monotonic() + 30
    while stats(stub).num_waiting:
        assert time.monotonic() < deadline, "the vanished client's request lives on"
        time.sleep(0.05)

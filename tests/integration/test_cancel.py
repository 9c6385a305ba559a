"""200 requests, half cancelled at random points (gRPC cancel and dropped
connections): afterwards every block is free and no request state is left in
the scheduler or the executor."""

from __future__ import annotations

import concurrent.futures
import random
import time

import grpc
import pytest

from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc, sampling_pb2
from tests.integration.test_serve import wait_until_idle

pytestmark = pytest.mark.integration


def one(server, i: int, rng: random.Random) -> str:
    req = gen.GenerateRequest(prompt=f"Item {i}:", max_tokens=rng.randint(2, 8))
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
    mode = "complete" if i % 2 == 0 else ("cancel" if i % 4 == 1 else "drop")
    cancel_after = rng.randint(0, 6)
    channel = grpc.insecure_channel(server.addr)
    call = generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=300)
    try:
        for n, resp in enumerate(call):
            if mode != "complete" and n >= cancel_after:
                if mode == "cancel":
                    call.cancel()
                else:
                    channel.close()  # the connection goes away under the stream
                return mode
            if resp.finish_reason:
                assert resp.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        return "complete"
    except grpc.RpcError as err:
        assert mode != "complete", err
        return mode
    finally:
        channel.close()


@pytest.mark.timeout(900)
def test_half_cancelled_load_leaves_nothing_behind(server):
    rng = random.Random(7)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda i: one(server, i, rng), range(200)))
    assert outcomes.count("complete") >= 100
    assert {"cancel", "drop"} <= set(outcomes)
    stats = wait_until_idle(server, timeout_s=30)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    deadline = time.monotonic() + 10  # the executor reports in its next idle heartbeat
    while server.stats().executor_num_sequences and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.stats().executor_num_sequences == 0

"""Hot reload on a real ``continuum serve``: a config change takes effect in scheduling.

Serve starts with ``--config-file`` (max_num_seqs 4, passed through to the scheduler);
``continuum config set max_num_seqs=1`` then makes two concurrent requests run one
after the other: the second's first token comes after the first's last, and Stats never
shows two running. A block-table snapshot taken while one streams holds its blocks, and
the telemetry store holds the same rows. ``stream_interval=4``, set live, streams the same
greedy tokens in messages of four.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from continuum import cli
from protos.continuum.v1 import scheduler_pb2 as pb
from protos.continuum.v1 import scheduler_pb2_grpc
from telemetry import TelemetryStore
from tests.conftest import TEST_METADATA
from tests.integration.conftest import start_server
from tests.integration.test_serve import chat

pytestmark = pytest.mark.integration
MAX_TOKENS = 48


def timed_run(server, question: str) -> tuple[float, float]:
    """(first token, last token) times of one greedy answer, as the client saw them."""
    times = []
    with grpc.insecure_channel(server.addr) as ch:
        for r in server.generation_stub(ch).Generate(
                chat(question, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=300):
            if r.token_ids:
                times.append(time.monotonic())
    assert times
    return times[0], times[-1]


def run_pair(server) -> tuple[list[tuple[float, float]], int]:
    """Two concurrent requests, ordered by first token; the most Stats saw running."""
    most, done = [0], threading.Event()

    def poll():
        while not done.is_set():
            most[0] = max(most[0], server.stats().num_running)
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda q: timed_run(server, q),
                                 ["Count to fifty.", "Name every planet."]))
    finally:
        done.set()
        poller.join()
    return sorted(runs), most[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("hot_reload")
    conf = tmp / "scheduler.json"
    # No queue-time bound: on a busy machine the second request may wait long for the first.
    conf.write_text('{"max_num_seqs": 4, "max_queue_time_standard_s": 0}')
    server = start_server(tmp, model_dir, "--kv-cache-bytes", str(96 << 20),
                          "--config-file", str(conf), "--telemetry-dsn",
                          str(tmp / "telemetry.sqlite"))
    server.store = tmp / "telemetry.sqlite"
    yield server
    assert server.stop() == 0, "".join(server.log[-30:])


def test_serve_passes_the_config_file_and_a_live_change_takes_effect(served, capsys):
    with grpc.insecure_channel(f"127.0.0.1:{served.scheduler_port}") as ch:
        admin = scheduler_pb2_grpc.SchedulerAdminStub(ch)
        first = admin.GetConfig(pb.GetConfigRequest(), timeout=10, metadata=TEST_METADATA)
    assert first.version == 1 and first.values["max_num_seqs"] == "4"
    assert "scheduler.json" in first.reason

    (a, b), most = run_pair(served)
    assert b[0] < a[1], "with 4 slots the two requests should run side by side"
    assert most <= 4

    with pytest.raises(SystemExit) as done:
        cli.main(["config", "set", "max_num_seqs=1", "--reason", "one at a time",
                  "--scheduler", f"127.0.0.1:{served.scheduler_port}"])
    assert done.value.code == 0 and "version 2" in capsys.readouterr().out

    (a, b), most = run_pair(served)
    assert b[0] >= a[1], "with max_num_seqs=1 the second must start after the first ended"
    assert most == 1


def test_block_table_snapshot_of_a_streaming_request(served, capsys):
    with grpc.insecure_channel(served.addr) as gch, \
            grpc.insecure_channel(f"127.0.0.1:{served.scheduler_port}") as sch:
        stream = served.generation_stub(gch).Generate(
            chat("Tell a long story.", max_tokens=400, ignore_eos=True), timeout=300)
        next(r for r in stream if r.token_ids)  # admitted: it holds blocks now
        snap = scheduler_pb2_grpc.SchedulerAdminStub(sch).SnapshotBlockTables(
            pb.SnapshotBlockTablesRequest(), timeout=10, metadata=TEST_METADATA)
        with pytest.raises(SystemExit) as done:
            cli.main(["config", "snapshot-blocks", "--scheduler",
                      f"127.0.0.1:{served.scheduler_port}"])
        stream.cancel()
    assert done.value.code == 0 and "(device):" in capsys.readouterr().out
    assert len(snap.tables) == 1
    table = snap.tables[0]
    assert table.block_ids and not table.is_swapped
    assert len(set(table.block_ids)) == len(table.block_ids)
    assert snap.num_free_blocks < snap.num_total_blocks
    deadline = time.monotonic() + 30  # the writer lingers up to 0.1 s per batch
    while True:
        with TelemetryStore.open(served.store, migrate=False) as store:
            rows = store.block_snapshot(snap.snapshot_id)
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r.request_id, r.block_ids, r.is_swapped) for r in rows] == [
        (table.request_id, tuple(table.block_ids), False)]


def greedy_responses(server, question: str) -> list[list[int]]:
    """The token ids of each Generate response of one greedy answer."""
    with grpc.insecure_channel(server.addr) as ch:
        return [list(r.token_ids) for r in server.generation_stub(ch).Generate(
            chat(question, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=300)
            if r.token_ids]


def test_a_live_stream_interval_sends_the_same_tokens_in_fewer_messages(served, capsys):
    question = "Name three rivers."
    each = greedy_responses(served, question)
    with pytest.raises(SystemExit) as done:
        cli.main(["config", "set", "stream_interval=4", "--reason", "fewer messages",
                  "--scheduler", f"127.0.0.1:{served.scheduler_port}"])
    assert done.value.code == 0
    try:
        gathered = greedy_responses(served, question)
    finally:
        with pytest.raises(SystemExit):
            cli.main(["config", "set", "stream_interval=1", "--scheduler",
                      f"127.0.0.1:{served.scheduler_port}"])
        capsys.readouterr()
    assert [t for r in gathered for t in r] == [t for r in each for t in r]  # greedy: same
    assert len(gathered[0]) < 4  # the first token is not held back for three more
    assert all(len(r) >= 4 for r in gathered[1:-1])
    assert len(gathered) <= 2 + (MAX_TOKENS - 1) // 4 < len(each)

"""Swap through `continuum serve`: ``--swap-space-bytes`` gives the executor a host KV
pool (its ``--swap-space-bytes``), so a device pool too small for the batch preempts
by swapping (copying a few blocks out and back costs less than re-prefilling them), and
every stream still finishes with the tokens of a run without pressure."""

from __future__ import annotations

import sqlite3
import time

import pytest

from tests.integration.conftest import start_server
from tests.integration.test_preemption import QUESTIONS, answers
from tests.integration.test_serve import wait_until_idle

pytestmark = pytest.mark.integration

BLOCK_BYTES = 16 * 46080  # one 16-token block of the test model's KV


def _swaps(store, num_requests: int) -> tuple[int, int]:
    """(swap, recompute) preemptions the telemetry store recorded, once it holds a row
    for each of ``num_requests`` (its writer runs behind the streams)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with sqlite3.connect(store) as db:
                row = db.execute("SELECT count(*), sum(preemptions_swap), "
                                 "sum(preemptions_recompute) FROM sequences").fetchone()
            if row[0] >= num_requests:
                return row[1] or 0, row[2] or 0
        except sqlite3.OperationalError:  # not created yet
            pass
        assert time.monotonic() < deadline, "the telemetry store missed sequences"
        time.sleep(0.2)


def test_serve_swaps_under_kv_pressure_and_outputs_stay_identical(server, tmp_path,
                                                                   model_dir):
    roomy = answers(server)
    store = tmp_path / "telemetry.sqlite"
    small = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(20 * BLOCK_BYTES),
                         "--max-num-seqs", "8", "--swap-space-bytes", "64MiB",
                         "--telemetry-dsn", str(store))
    try:
        tight = answers(small)
        stats = wait_until_idle(small)
        assert stats.num_preemptions > 0, "the small pool should have forced preemption"
        assert stats.num_free_blocks == stats.num_total_blocks
        swaps, _ = _swaps(store, len(QUESTIONS))
        assert swaps > 0, "a host pool was given, yet every preemption recomputed"
    finally:
        assert small.stop() == 0
    assert tight == roomy

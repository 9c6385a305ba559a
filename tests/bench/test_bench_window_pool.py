"""bench_window_pool on a small pool: releasing the blocks behind the window runs more of
the long-context workload at once, and drains it in fewer steps."""

from __future__ import annotations

import argparse

from benchmarks import bench_window_pool


def test_released_blocks_hold_more_sequences_in_the_same_pool(capsys):
    args = argparse.Namespace(blocks=4096, block_size=16, window=2048, requests=8,
                              output=512, budget=2048)
    kept, released = bench_window_pool.run(0, args), bench_window_pool.run(2048, args)
    assert kept["held"] <= 4096 and released["held"] <= 4096
    assert released["most"] > kept["most"] and released["steps"] < kept["steps"]
    bench_window_pool.main(["--blocks", "2048", "--requests", "4", "--output", "64"])
    out = capsys.readouterr().out
    assert "released" in out and "kept (no window known)" in out

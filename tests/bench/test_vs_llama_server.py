"""benchmarks/vs_llama_server.py drives two OpenAI-compatible servers with one workload
and prints its comparison table. llama-server is not built here, so a second
address of the same real ``continuum serve`` stands in for it: the plumbing (requests,
figures, table, verdict) is what is tested, not the ratio."""

from __future__ import annotations

import json
import socket

import pytest

from benchmarks import vs_llama_server

pytestmark = pytest.mark.integration


def test_compares_two_real_servers_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    with vs_llama_server._ours(None, ["--kv-cache-bytes", str(64 << 20)]) as (url, pids):
        assert set(pids) == {"gateway", "scheduler_svc", "executor_svc"}  # what it measures
        code = vs_llama_server.main(["--llama-url", url, "--ours-url", url, "--streams", "1,3",
                                     "--input-len", "16", "--output-len", "4",
                                     "--prompts-per-stream", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code in (0, 1)  # the verdict depends on noise between two runs of one server
    rows = json.loads(out.read_text())
    assert [r["streams"] for r in rows] == [1, 3]
    for r in rows:
        requests = max(r["streams"], 2)  # one prompt per stream, at least two per side
        for side in ("ours", "theirs"):
            assert r[side]["num_completed"] == requests
            assert r[side]["total_output_tokens"] == 4 * requests
        assert r["ours_cores"] == {}  # a server given by --ours-url: its processes unknown
        assert r["ratio"] == pytest.approx(
            r["ours"]["output_throughput"] / r["theirs"]["output_throughput"])
    assert "| streams | llama-server tok/s | ours tok/s |" in printed
    assert printed.count("\n| 1 |") == 1 and printed.count("\n| 3 |") == 1


def test_a_server_that_answers_nothing_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(SystemExit) as caught:
        vs_llama_server.main(["--llama-url", dead, "--ours-url", dead, "--streams", "1",
                              "--output-len", "2"])
    assert "0 of 2 requests completed at 1 streams" in str(caught.value)
    assert "CONNECTION" in str(caught.value)


def test_a_row_misses_when_ratio_or_ttft_fall_short():
    fast = {"output_throughput": 300.0, "ttft_median_ms": 50.0, "ttft_p99_ms": 90.0,
            "num_requests": 8, "num_completed": 8}
    slow = {**fast, "output_throughput": 100.0, "ttft_median_ms": 80.0, "ttft_p99_ms": 99.0}
    assert vs_llama_server._row(8, fast, slow)["met"]  # 3x >= 2x, lower TTFTs
    assert vs_llama_server._row(32, fast, slow)["met"]  # 3x >= 3x
    assert not vs_llama_server._row(32, {**fast, "output_throughput": 290.0}, slow)["met"]
    assert not vs_llama_server._row(8, slow, fast)["met"]
    assert not vs_llama_server._row(8, {**fast, "ttft_p99_ms": 120.0}, slow)["met"]

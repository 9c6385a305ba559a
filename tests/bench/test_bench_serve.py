"""benchmarks/bench_serve.py is a thin entry point over `continuum bench`: the rows it
runs are the load generator's closed loops, and failed requests are counted, not hidden.
(The load generator itself runs end to end against a real server in
tests/integration/test_openai_api.py::test_continuum_bench_runs_a_mixed_workload.)"""

from __future__ import annotations

import math
import socket

import pytest

from benchmarks import bench_serve
from continuum.bench.workload import build_workload


def test_a_row_is_a_closed_loop_of_c_clients():
    args = bench_serve.bench_args("grpc", "127.0.0.1:1", "http://127.0.0.1:2/v1",
                                  concurrency=4, rounds=3, max_tokens=16, input_len=40, seed=9)
    assert (args.num_prompts, args.max_concurrency, args.dataset) == (12, 4, "fixed")
    specs = build_workload(args, math.inf)
    assert {(len(s.prompt_ids), s.max_tokens, s.arrival_s) for s in specs} == {(40, 16, 0.0)}
    assert all(s.cancel_after is None for s in specs)


def test_bad_flags_are_one_clear_error(capsys):
    with pytest.raises(SystemExit) as caught:
        bench_serve.main(["--concurrency", "4", "0"])
    assert caught.value.code == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err


def test_failed_requests_are_counted_and_fail_the_run(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = bench_serve.main(["--addr", f"127.0.0.1:{port}", "--concurrency", "2",
                             "--rounds", "1", "--max-tokens", "2"])
    out = capsys.readouterr()
    assert code == 1
    assert out.out.splitlines()[0].split()[0] == "clients"
    assert out.out.splitlines()[1].split()[:2] == ["2", "0.0"]  # 2 clients, no tokens
    assert "errors: UNAVAILABLE × 2" in out.err

"""One data directory, one trace reader: the simulator and `continuum bench` see the same
rows, both follow $CONTINUUM_DATA_DIR, and an unusable trace is one clear error."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from continuum.bench.run import add_arguments
from continuum.bench.workload import BenchError, build_workload
from sim.data import TraceError, data_dir, default_trace, read_trace
from sim.workload import load_trace

HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens,extra\n"


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rows_in_file_order_and_both_readers_agree(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "3.0,30,3,x\n1.0,10,1,y\n2.0,20,2,z\n")
    assert read_trace(trace) == [(3.0, 30, 3), (1.0, 10, 1), (2.0, 20, 2)]
    # The simulator sorts by arrival and scales time; the lengths are the same rows.
    sim = load_trace(trace, rate_scale=2.0)
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in sim] == \
        [(0.5, 10, 1), (1.0, 20, 2), (1.5, 30, 3)]
    assert [r.arrival_s for r in load_trace(trace, duration_s=2.0)] == [1.0]


def test_the_load_generator_replays_what_the_simulator_replays(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "10.0,40,4,x\n10.5,50,5,y\n12.0,60,6,z\n")
    sim = [(r.arrival_s - 10.0, r.num_prompt_tokens, r.num_output_tokens)
           for r in load_trace(trace)]
    specs = build_workload(bench_args("--dataset", "replay", "--trace", str(trace),
                                      "--num-prompts", "3", "--length-scale", "1"), 1.0)
    assert [(s.arrival_s, len(s.prompt_ids), s.max_tokens) for s in specs] == sim


@pytest.mark.parametrize("text,words", [
    ("arrived_at,num_prefill_tokens\n1.0,10\n", "expected columns arrived_at, "
     "num_prefill_tokens, num_decode_tokens"),
    (HEADER + "1.0,ten,1,x\n", "expected columns"),
    (HEADER + "1.0,10\n", "expected columns"),  # a short row
    (HEADER, "has no rows"),
    ("", "has no rows"),
])
def test_an_unusable_trace_is_one_clear_error(tmp_path, text, words):
    trace = tmp_path / "bad.csv"
    trace.write_text(text)
    with pytest.raises(TraceError, match=words) as caught:
        read_trace(trace)
    assert str(trace) in str(caught.value)
    with pytest.raises(BenchError, match=f"--trace .*{words}"):
        build_workload(bench_args("--dataset", "azure", "--trace", str(trace)), 1.0)


def test_missing_and_unreadable_traces(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path)  # a directory


def test_every_default_follows_continuum_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONTINUUM_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path
    assert default_trace() == tmp_path / "traces" / "azure_conv_2023.csv"
    # continuum bench's --trace default was a path beside the repository, whatever the
    # variable said; now it is the same file the simulator reads.
    with pytest.raises(BenchError, match=f"--trace {tmp_path}/traces/azure_conv_2023.csv: "
                                         "no such file"):
        build_workload(bench_args("--dataset", "azure"), 1.0)
    (tmp_path / "traces").mkdir()
    default_trace().write_text(HEADER + "0.5,7,3,x\n")
    specs = build_workload(bench_args("--dataset", "azure", "--num-prompts", "2",
                                      "--length-scale", "1"), 1.0)
    assert [(len(s.prompt_ids), s.max_tokens) for s in specs] == [(7, 3), (7, 3)]


def test_the_simulator_reports_a_missing_file_in_one_line(tmp_path):
    """A bad --trace, and a data directory without the cost model's profiles."""
    missing = tmp_path / "nope.csv"
    argv = [sys.executable, "-m", "sim", "--policy", "chunked", "--duration-s", "1"]
    if (data_dir() / "profiles" / "a100").is_dir():
        run = subprocess.run([*argv, "--trace", str(missing)], capture_output=True,
                             text=True, timeout=120)
        assert (run.returncode, run.stderr.strip()) == \
            (2, f"python -m sim: --trace {missing}: no such file")
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CONTINUUM_DATA_DIR": str(tmp_path)})
    assert run.returncode == 2
    assert run.stderr.startswith(f"python -m sim: {tmp_path}/profiles/a100/")
    assert "CONTINUUM_DATA_DIR" in run.stderr and "Traceback" not in run.stderr

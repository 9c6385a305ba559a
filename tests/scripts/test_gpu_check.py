"""scripts/gpu_check.sh on the CPU (DRY_RUN=1), so the GPU check does not rot between the
rare runs on a lent GPU: the script parses, the 8B-shaped benchmark (scripts/gpu_bench.py)
runs end to end at a toy shape through the executor's Runner, and one table comes out."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spawns  # starts processes of its own (tests/tiers.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_prints_one_table_of_every_check():
    env = {**os.environ, "DRY_RUN": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "gpu_check: dry run (no GPU checked)"
    table = [line for line in lines if line.startswith("| ")]
    assert table[0] == "| check | result | figures |"
    assert lines.count("| check | result | figures |") == 1  # ONE table
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in table[1:]}
    assert rows["CUDA device"] == "SKIP"
    assert rows["bundled model on cuda (tests/executor/test_cuda.py)"] == "SKIP"
    for name in ("decode step, batch 1, context 64", "decode step, batch 4, context 64",
                 "prefill 64 tokens", "serving, 4 in flight, trace length mix",
                 "plan round trip, 64 running"):
        assert rows[name] == "PASS", name
    assert "FAIL" not in rows.values()


def test_the_bundle_carries_an_evenly_spaced_sample_of_the_trace(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bundle", ROOT / "scripts" / "gpu_bundle.py")
    bundle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle)
    src = tmp_path / "trace.csv"
    src.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                   + "".join(f"{i}.0,{i},{2 * i}\n" for i in range(100)))
    assert bundle.sample_trace(src, tmp_path / "sample.csv", 10) == 10
    lines = (tmp_path / "sample.csv").read_text().splitlines()
    assert lines[0].startswith("arrived_at") and lines[1:3] == ["0.0,0,0", "10.0,10,20"]
    assert len(lines) == 11


def _pytest_check(tmp_path, test_source: str) -> str:
    """The GPU check's verdict (scripts/gpu_check_lib.sh) on one test file of ours."""
    test = tmp_path / "test_sample.py"
    test.write_text(test_source)
    script = ('add() { echo "ROW|$1|$2|$3"; }\n'
              f'PY={sys.executable}; DRY_RUN=0; out={tmp_path}\n'
              'source scripts/gpu_check_lib.sh\n'
              f'pytest_check sample 120 {test}\n')
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=150)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("ROW|")]
    assert len(rows) == 1, proc.stdout + proc.stderr
    return rows[0]


def test_a_test_meant_to_skip_on_a_gpu_does_not_fail_the_check(tmp_path):
    row = _pytest_check(tmp_path, (
        "import pytest\n"
        "def test_runs():\n    assert True\n"
        "@pytest.mark.skip(reason='CPU-only: checks what a machine without CUDA does')\n"
        "def test_cpu_only():\n    pass\n"))
    assert row.startswith("ROW|sample|PASS|") and "1 meant to skip on a GPU" in row


def test_a_test_skipped_for_a_missing_dependency_fails_the_check(tmp_path):
    row = _pytest_check(tmp_path, (
        "import pytest\n"
        "def test_runs():\n    assert True\n"
        "@pytest.mark.skip(reason='CPU-only: by design')\n"
        "def test_cpu_only():\n    pass\n"
        "def test_needs_flash():\n    pytest.importorskip('no_such_gpu_dependency')\n"))
    assert row.startswith("ROW|sample|FAIL|tests skipped: 1")
    assert "no_such_gpu_dependency" in row


def test_a_failing_test_fails_the_check(tmp_path):
    row = _pytest_check(tmp_path, "def test_wrong():\n    assert 1 == 2\n")
    assert row.startswith("ROW|sample|FAIL|exit status 1")

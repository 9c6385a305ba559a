"""``python -m benchmarks.capacity_check --quick``: the audit's verdict next to the
simulator's and a real ``continuum serve``'s at the same load.

The profile is written here (a 135M-like model on 2 cores: 40 ms a step plus 3 ms a
token), so the audit and the simulator see the same machine whatever this one's load;
the real run's verdict depends on this machine, so only its presence is asserted.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sim.profile import FEATURES, ExecutorProfile

pytestmark = pytest.mark.spawns  # starts service processes (tests/tiers.py)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "capacity"


@pytest.fixture
def profile(tmp_path) -> Path:
    c = dict.fromkeys(FEATURES, 0.0)
    c.update(step=0.040, tokens=0.003, decode_kv_tokens=1e-6, mixed=0.005)
    path = tmp_path / "profile.json"
    ExecutorProfile(c, 46080, 96 << 20, 1e9, 300.0, machine={"cpu": "test", "cores": 2},
                    executor={"model": "135M-like"}).save(path)
    return path


def _check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.capacity_check", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _verdicts(stdout: str) -> dict[tuple[str, str], str]:
    """(workload, source) -> WITHIN / EXCEEDS, from the printed table."""
    out = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 3 and cells[1] in ("audit", "simulator", "real"):
            out[cells[0], cells[1]] = cells[-1].split()[0]
    return out


def test_quick_check_prints_three_verdicts_and_audit_agrees_with_simulator_when_over(profile):
    res = _check("--profile", str(profile), "--quick")
    assert res.returncode == 0, res.stderr[-3000:]
    verdicts = _verdicts(res.stdout)
    for workload in ("local-workload", "local-workload-over"):
        for source in ("audit", "simulator", "real"):
            assert verdicts.get((workload, source)) in ("WITHIN", "EXCEEDS"), res.stdout
    # Over the bound: the fluid screen and the trace replay must both reject the plan.
    assert verdicts["local-workload-over", "audit"] == "EXCEEDS"
    assert verdicts["local-workload-over", "simulator"] == "EXCEEDS"
    assert verdicts["local-workload", "audit"] == "WITHIN"
    assert re.search(r"^local-workload-over: audit EXCEEDS, simulator EXCEEDS, real \w+ -> ",
                     res.stdout, re.M), res.stdout


def test_workload_of_another_contract_is_refused(profile):
    res = _check("--profile", str(profile), "--no-real",
                 "--workload", str(DOCS / "illustrative-workload.toml"))
    assert res.returncode == 2
    assert "written for contract 'illustrative-70b-partitioned'" in res.stderr


def test_a_file_that_is_not_a_profile_is_refused(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    res = _check("--profile", str(bad), "--no-real")
    assert res.returncode == 2
    assert "not a continuum.executor_profile.v1 file" in res.stderr

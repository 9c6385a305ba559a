"""The partitioned capacity model (continuum/capacity/partitioned.py) on the illustrative
contract and on variations of it: its figures, the binding of a workload to its contract,
bounds that fail, and overload degrading the lowest-priority class first."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from fractions import Fraction
from pathlib import Path

import pytest

from continuum.capacity import audit, partitioned
from continuum.capacity.contract import RequestClass, content_id, parse_contract, parse_workload

DOCS = Path(__file__).resolve().parents[2] / "docs" / "capacity"
CONTRACT, WORKLOAD = DOCS / "illustrative-contract.toml", DOCS / "illustrative-workload.toml"
FIGURES = ("example=illustrative_only",
           "decision=CAPACITY_WITHIN_DECLARED_BOUND",
           "utilization_permille=180;prefill=250;decode=75 ",
           "queue_ms=5.1;worst_ttft_ms=185.1;tpot_ms=20;",
           "peak_kv_bytes=8808038400 ",
           "claim=FLUID_CAPACITY_MODEL_NOT_A_MEASUREMENT")


def one(name: str, tier: int, rate, prompt: int, output: int) -> RequestClass:
    return RequestClass(name, tier, rate, prompt, output, prompt, output)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`continuum capacity ARGS` in this process (the first test runs the real command)."""
    import contextlib
    import io

    from continuum.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as done:
        main(["capacity", *args])
    return subprocess.CompletedProcess(args, done.value.code, out.getvalue(), err.getvalue())


def _toml(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def _write(tmp_path: Path, name: str, data: dict) -> Path:
    import json

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def _bound(tmp_path: Path, contract: dict, workload: dict) -> tuple[Path, Path]:
    """Both files, the workload rebound to the (changed) contract."""
    workload = {**workload, "contract_content_id": content_id(contract)}
    return _write(tmp_path, "contract", contract), _write(tmp_path, "workload", workload)


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_the_illustrative_contract_prints_its_figures():
    done = subprocess.run([sys.executable, "-m", "continuum", "capacity", "audit",
                           str(CONTRACT), str(WORKLOAD)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(any(line.startswith(f) for line in lines) for f in FIGURES), done.stdout
    assert "prefill_chunk_tokens=480" in done.stdout  # 24,000 token/s x 20 ms
    assert "capped at 480" in done.stdout  # the declared 512 is not trusted


def test_a_workload_is_bound_to_its_contract_by_name_and_content(tmp_path):
    contract, workload = _toml(CONTRACT), _toml(WORKLOAD)
    changed = {**contract, "model": {**contract["model"], "iteration_ms": 25}}
    assert content_id(changed) != workload["contract_content_id"]
    c_path = _write(tmp_path, "contract", changed)
    done = _cli("audit", str(c_path), str(WORKLOAD))
    assert done.returncode == 2
    assert "written for another version of contract" in done.stderr
    other_name = _write(tmp_path, "workload", {**workload, "contract": "elsewhere"})
    assert _cli("audit", str(CONTRACT), str(other_name)).returncode == 2
    # Comments and layout are not content: the shipped TOML and its JSON copy bind alike.
    assert _cli("content-id", str(_write(tmp_path, "copy", contract))).stdout.strip() == \
        workload["contract_content_id"]


def test_bad_contracts_are_every_problem_at_once(tmp_path):
    contract = _toml(CONTRACT)
    contract["model"].update(prefill_partition_per_s=30000, block_size=0, iteration_msec=20)
    done = _cli("audit", str(_write(tmp_path, "c", contract)), str(WORKLOAD))
    assert done.returncode == 2
    assert "block_size must be > 0, got 0" in done.stderr
    assert "unknown key 'iteration_msec' (did you mean 'iteration_ms'?)" in done.stderr


def test_partitions_over_the_budget_are_refused(tmp_path):
    contract = _toml(CONTRACT)
    contract["model"]["prefill_partition_per_s"] = 30000
    done = _cli("audit", str(_write(tmp_path, "c", contract)), str(WORKLOAD))
    assert done.returncode == 2
    assert "must be <= token_budget_per_s (40000)" in done.stderr


def test_overload_degrades_the_lowest_priority_class_first(tmp_path):
    workload = _toml(WORKLOAD)
    workload["classes"][1]["rate_per_s"] = 5  # summarize x20: the prefill partition is over
    c_path, w_path = _bound(tmp_path, _toml(CONTRACT), workload)
    done = _cli("audit", str(c_path), str(w_path))
    assert done.returncode == 1
    assert f"decision={audit.SHED}" in done.stdout
    assert "over_bounds=" in done.stdout and "prefill_utilization" in done.stdout
    shed = [line for line in done.stdout.splitlines() if line.startswith("shed ")]
    assert len(shed) == 1 and shed[0].startswith("shed class=summarize;")
    admitted = float(shed[0].split("<=")[1].split()[0])
    assert 0 < admitted < 5
    k = parse_contract(_toml(CONTRACT))
    w = parse_workload(workload)
    trial = (w.classes[0], one("summarize", 1, Fraction(str(admitted)) * Fraction(999, 1000),
                               4032, 192))
    assert not partitioned.evaluate(k, trial).violations  # what it admits fits


def test_tpot_grows_when_the_decode_partition_cannot_serve_every_sequence():
    import dataclasses

    k = parse_contract(_toml(CONTRACT))
    k = dataclasses.replace(k, model=dataclasses.replace(
        k.model, decode_partition_per_s=8000))  # 160 tokens / iteration
    # Long answers at 99.75 % of the decode partition: while each sequence waits for its
    # prompt, more are active than one iteration serves, so each gets a token every k.
    many = (one("long", 0, 3.99, 4032, 2000),)
    report = partitioned.evaluate(k, many)
    assert report.active > 160
    assert report.tpot_ms == 20 * -(-report.active // 160)
    assert report.tpot_ms > 20
    assert {"tpot_ms", "active_sequences", "decode_utilization"} <= set(report.violations)


def test_a_saturated_partition_is_infinite_not_an_error():
    k = parse_contract(_toml(CONTRACT))
    flood = (one("flood", 0, 100, 1000, 10),)
    report = partitioned.evaluate(k, flood)
    assert report.queue_ms == partitioned.INF
    assert "queue_ms=inf;worst_ttft_ms=inf" in audit.render(k, audit.decide(k, flood))


@pytest.mark.parametrize("bad", [{"rate_per_s": -1}, {"tier": "high"}, {"prompt_tokens": 1.5},
                                 {"cancel_fraction": 0.1}])
def test_bad_classes_name_the_field(tmp_path, bad):
    workload = _toml(WORKLOAD)
    workload["classes"][0].update(bad)
    done = _cli("audit", str(CONTRACT), str(_write(tmp_path, "w", workload)))
    assert done.returncode == 2
    assert f"class 'chat': {next(iter(bad))}" in done.stderr


def _profile(tmp_path: Path, step_s: float, per_token_s: float) -> Path:
    from sim.profile import FEATURES, ExecutorProfile

    coefficients = dict.fromkeys(FEATURES, 0.0)
    coefficients.update(step=step_s, tokens=per_token_s)
    path = tmp_path / "profile.json"
    ExecutorProfile(coefficients, kv_bytes_per_token=36864, kv_pool_bytes=1 << 30,
                    copy_bytes_per_s=1e10, prefill_tokens_per_s=1000.0,
                    machine={"cpu": "test"}).save(path)
    return path


def test_from_profile_audits_what_this_machine_serves(tmp_path):
    # 10 ms a step plus 0.1 ms a token: a 20 ms iteration holds 100 tokens, split 60:40
    # as the contract's partitions are: 3,000 prompt and 2,000 decode tokens a second.
    profile = _profile(tmp_path, 0.010, 0.0001)
    workload = _toml(WORKLOAD)
    workload["classes"] = [{"name": "chat", "tier": 0, "rate_per_s": 2, "prompt_tokens": 300,
                            "output_tokens": 100}]
    c_path, w_path = _bound(tmp_path, _toml(CONTRACT), workload)
    done = _cli("audit", str(c_path), str(w_path), "--from-profile", str(profile))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "served_per_iteration=decodes:40,prefill_tokens:60," in done.stdout
    assert "declared_token_budget_per_s=40000;served=5000;prefill=3000;decode=2000" in lines
    assert "utilization_permille=160;prefill=200;decode=100 (bound 850)" in lines  # 800/5000
    assert "note=the contract declares more token/s than this machine serves" in done.stdout
    workload["classes"][0]["rate_per_s"] = 9  # 2,700 of 3,000 prompt tokens/s: over 850 ‰
    c_path, w_path = _bound(tmp_path, _toml(CONTRACT), workload)
    over = _cli("audit", str(c_path), str(w_path), "--from-profile", str(profile))
    assert over.returncode == 1
    assert f"decision={audit.OVER}" in over.stdout  # one tier: nothing below it to shed
    assert "prefill_utilization" in over.stdout


def test_from_profile_needs_a_profile_and_a_partitioned_contract(tmp_path):
    bad = tmp_path / "nope.json"
    bad.write_text("{}")
    done = _cli("audit", str(CONTRACT), str(WORKLOAD), "--from-profile", str(bad))
    assert done.returncode == 2 and "not a continuum.executor_profile.v1 file" in done.stderr
    old = _cli("audit", str(DOCS / "contract.toml"), str(DOCS / "workload.toml"),
               "--from-profile", str(_profile(tmp_path, 0.01, 0.0001)))
    assert old.returncode == 2 and "--from-profile screens a partitioned contract" in old.stderr

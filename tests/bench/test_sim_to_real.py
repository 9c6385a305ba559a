"""The sim-to-real loop, small. ``benchmarks.fit_profile --quick`` measures the real
executor in this process and writes a profile; ``benchmarks.sim_validate --quick`` starts
a real ``continuum serve``, replays three rates of tiny Azure-mix requests through it and
through the simulator. Asserted: both run, every figure reported is finite, and both
sides account for the same requests. Not accuracy: CI machines are shared and a quick
profile has eight points (the validation takes a stated profile, so the two tests do not
wait on each other)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import fit_profile, sim_validate
from sim.profile import ExecutorProfile
from tests.sim.test_profile import make_profile

# Seconds on a quiet machine; on one shared by many (load 15 on 2 cores) a prefill step of
# the fit took 10-25 s and the fit 5 minutes, past the suite's 300 s default.
LOADED_MACHINE_TIMEOUT_S = 900


@pytest.mark.timeout(LOADED_MACHINE_TIMEOUT_S)
def test_fit_profile_quick_measures_the_executor(tmp_path, model_dir):
    path = tmp_path / "profile.json"
    assert fit_profile.main(["--quick", "--repeats", "1", "--kv-cache-bytes", str(64 << 20),
                             "--out", str(path)]) == 0
    profile = ExecutorProfile.load(path)
    assert profile.executor["weight_format"] and profile.executor["attention_backend"]
    assert profile.machine["git_rev"] and profile.machine["cpu"]
    assert profile.fit["num_points"] == 8 and len(profile.fit["points"]) == 8
    assert all(p["seconds"] > 0 for p in profile.fit["points"])
    assert all(v >= 0 for v in profile.coefficients.values())
    assert profile.decode_step_time(4, 64) > 0 and profile.copy_bytes_per_s > 0


@pytest.mark.timeout(LOADED_MACHINE_TIMEOUT_S)
@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_validate_against_a_real_server(tmp_path, model_dir, capsys):
    from sim.data import default_trace

    if not default_trace().exists():  # the workload is the Azure trace's length mix
        pytest.skip(f"the Azure trace is not at {default_trace()} ($CONTINUUM_DATA_DIR)")
    profile_path = tmp_path / "profile.json"
    make_profile().save(profile_path)
    out = tmp_path / "validate.json"
    assert sim_validate.main(["--profile", str(profile_path), "--quick", "--rates", "4,8,16",
                              "--speed-from-run", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("| rate req/s | figure | measured | simulated | error % | simulated at the run's "
            "speed | error % at the run's speed |") in printed
    assert "took" in printed
    result = json.loads(out.read_text())
    rows, summary = result["rows"], result["summary"]
    assert len(rows) == 3 * len(sim_validate.FIGURES)
    for row in rows:
        if row["figure"] in ("output tok/s", "TTFT p50 ms", "TTFT p99 ms"):
            assert math.isfinite(row["measured"]) and math.isfinite(row["simulated"]), row
            assert math.isfinite(row["error %"]), row
    assert math.isfinite(summary["median_abs_error_pct"])
    expected = sim_validate.QUICK.num_prompts + sim_validate.QUICK.burst
    for side in summary["counts"]:
        for counts in side.values():
            assert counts["requests"] == expected
            assert counts["completed"] + counts["refused"] == expected
            assert counts["completed"] > 0
            # Both sides ran steps: the server's from its telemetry store.
            steps = counts["step figures"]
            assert steps["steps"] > 0 and steps["mean step ms"] > 0, steps
            assert steps["prompt tokens"] > 0 and steps["seqs a step"] > 0, steps
    assert 0 < summary["speed_scale"] < math.inf
    assert set(summary["run_speed"]) == {"median_abs_error_pct", "max_abs_p50_error_pct"}


def test_the_run_speed_is_read_back_from_steps_priced_at_a_known_speed():
    """Decode-only steps as a server 1.2x slower than the fit would run them, with the
    calibrated overheads on top: run_speed finds 1.2, whatever the batch and context; and
    1.5 for the steps with a prompt, priced apart."""
    calibrated = make_profile(speed_scale=0.9, link_overhead_s=2e-3,
                              link_overhead_per_seq_s=4e-4)
    slower = make_profile(speed_scale=1.2, link_overhead_s=2e-3, link_overhead_per_seq_s=4e-4)
    steps = [(slower.decode_step_time(seqs, ctx), seqs, 0, seqs * ctx)
             for seqs, ctx in ((1, 40), (4, 100), (9, 333), (24, 80), (30, 512))]
    # Steps with a prompt beside the decodes, as a server 1.5x slower would run them.
    mixed = make_profile(speed_scale=1.5, link_overhead_s=2e-3, link_overhead_per_seq_s=4e-4)
    steps += [(mixed.step_time([(1, 60)] * seqs + [(prompt, 0)]), seqs, prompt, 60 * (seqs + 1))
              for seqs, prompt in ((0, 256), (2, 64), (7, 128))]
    assert sim_validate.run_speed(calibrated, steps) == pytest.approx(1.2)
    assert sim_validate.run_speed(calibrated, steps, prompts=True) == pytest.approx(1.5)
    assert sim_validate.run_speed(calibrated, []) is None

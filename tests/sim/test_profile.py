"""sim/profile.py: the fitted executor profile prices plans, round-trips through JSON, and
its fit recovers a known model; the simulator runs on it."""

from __future__ import annotations

import json
import math

import pytest

from sim.__main__ import main as sim_main
from sim.engine import Simulation, policy_config
from sim.profile import (
    FEATURES,
    SCHEMA,
    ExecutorProfile,
    errors_pct,
    fit_coefficients,
    nnls,
    plan_counts,
)
from sim.workload import poisson_class

KNOWN = {"step": 4e-3, "tokens": 2e-4, "tokens_over_64": 1e-4, "tokens_over_256": 0.0,
         "seqs": 3e-4, "sampled": 1e-3, "decode_kv_tokens": 2e-6, "prefill_kpairs": 5e-6,
         "mixed": 2e-3}


def make_profile(**overrides) -> ExecutorProfile:
    fields = dict(coefficients=dict(KNOWN), kv_bytes_per_token=46080,
                  kv_pool_bytes=512 * 16 * 46080, copy_bytes_per_s=5e9,
                  prefill_tokens_per_s=2000.0)
    fields.update(overrides)
    return ExecutorProfile(**fields)


def test_a_step_is_the_dot_product_of_its_counts():
    p = make_profile()
    seqs = [(1, 99)] * 4 + [(128, 0)]
    assert plan_counts(seqs, 4) == (132, 5, 4, 400, 128 * 64.5 / 1e3)
    expected = (4e-3 + 132 * 2e-4 + (132 - 64) * 1e-4 + 5 * 3e-4 + 4 * 1e-3 + 400 * 2e-6
                + 8.256 * 5e-6 + 2e-3)
    assert p.step_time(seqs, 4) == pytest.approx(expected)
    assert p.step_time([]) == 0.0
    assert p.decode_step_time(8, 512) < p.decode_step_time(16, 512) < p.decode_step_time(16, 1024)
    assert p.swap_time(10, 16) == pytest.approx(10 * 16 * 46080 / 5e9)
    assert p.num_kv_blocks(16) == 512
    assert p.core_cost_model(16).block_bytes == 16 * 46080
    # A server's measured overhead: per step, and per sampled sequence.
    served = make_profile(link_overhead_s=2e-3, link_overhead_per_seq_s=5e-4)
    assert served.step_time(seqs, 4) == pytest.approx(expected + 2e-3 + 4 * 5e-4)
    # Admitting a request costs the step that starts its prefill, not a later chunk's.
    admitting = make_profile(link_overhead_per_prompt_s=1e-2)
    assert admitting.step_time(seqs, 4) == pytest.approx(expected + 1e-2)
    assert admitting.step_time([(128, 0), (64, 0)]) == pytest.approx(
        make_profile().step_time([(128, 0), (64, 0)]) + 2e-2)
    assert admitting.step_time([(128, 64)]) == pytest.approx(make_profile().step_time([(128, 64)]))
    assert admitting.step_time([(1, 99)]) == pytest.approx(make_profile().step_time([(1, 99)]))
    # The machine's speed in a server run scales the fitted part, not the measured overhead.
    slower = make_profile(speed_scale=1.25, link_overhead_s=2e-3)
    assert slower.step_time(seqs, 4) == pytest.approx(1.25 * expected + 2e-3)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="speed_scale"):
            make_profile(speed_scale=bad)


def test_the_fit_recovers_a_known_model_and_never_goes_negative():
    truth = make_profile()
    plans = [[(1, c)] * b for b in (1, 4, 16, 64) for c in (16, 256, 1024)]
    plans += [[(q, c)] for q in (16, 64, 200, 512, 2048) for c in (0, 512)]
    plans += [[(1, 128)] * b + [(q, 0)] for b in (2, 8, 32) for q in (64, 300)]
    points = []
    for plan in plans:
        counts = plan_counts(plan)
        points.append({"counts": [*counts, any(q > 1 for q, _ in plan)],
                       "seconds": truth.step_time(plan)})
    fitted = fit_coefficients(points)
    assert all(v >= 0 for v in fitted.values())
    assert max(abs(e) for e in errors_pct(fitted, points)) < 0.5
    # A column whose best unconstrained weight is negative is pinned to zero.
    coef = nnls([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [3.0, 2.0, 1.0])
    assert coef[1] == 0.0 and coef[0] == pytest.approx(2.0)


def test_json_round_trip_and_a_bad_file_is_one_clear_error(tmp_path, capsys):
    path = tmp_path / "p.json"
    make_profile(machine={"cpu": "test"}).save(path)
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["features"] == list(FEATURES)
    loaded = ExecutorProfile.load(path)
    assert loaded.step_time([(1, 10)] * 3) == make_profile().step_time([(1, 10)] * 3)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something else"}')
    with pytest.raises(ValueError, match="bad.json: not a"):
        ExecutorProfile.load(bad)
    assert sim_main(["--profile", str(bad), "--policy", "chunked"]) == 2
    assert "fit_profile" in capsys.readouterr().err
    data["coefficients"].pop("seqs")
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks coefficients"):
        ExecutorProfile.load(bad)


def test_the_simulator_runs_on_a_profile():
    reqs = poisson_class(4.0, 20.0, 100, 20, "default", 1, seed=3)
    res = Simulation(reqs, policy_config("chunked", 32), make_profile()).run()
    assert len(res.finished) == len(reqs)
    assert res.num_output_tokens == sum(r.num_output_tokens for r in reqs)
    assert math.isfinite(res.end_s) and res.end_s > reqs[-1].arrival_s

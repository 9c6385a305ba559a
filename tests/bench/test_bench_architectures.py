"""bench_architectures: every registered architecture gets a row, each one's features
build a model that decodes, and a point's figures are a step time and a bound that the
step cannot beat by much (the roofline is measured, not assumed)."""

from __future__ import annotations

import time
import types

import pytest

from benchmarks import bench_architectures as bench
from executor_svc.models import registry
from executor_svc.settings import Switches
from kernels import make_backend

TINY = dict(hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
            head_dim=16, vocab_size=96, max_position_embeddings=512)


@pytest.mark.parametrize("arch", [a.name for a in registry.ARCHITECTURES])
def test_each_architecture_decodes_with_its_features_on(arch):
    model = bench.random_at(arch, TINY)
    config = model.config
    for field, value in bench.features(arch, TINY).items():
        assert getattr(config, field) == value, field
    run = bench.DecodeRun(model, make_backend("numba"), 2, 300, 3)  # past the 256 window
    assert run.timed(1, 2) > 0


def test_every_architecture_has_a_row_against_llama():
    args = types.SimpleNamespace(switches=Switches.from_env(), model=[])
    rows = bench.rows(args)
    names = [a.name for a in registry.ARCHITECTURES]
    random_rows = [r for r in rows if "(random" in r.name]
    assert [r.name.split()[0] for r in random_rows] == names
    assert {r.baseline for r in random_rows} == {"llama (random, fp32)"}
    assert any("(checkpoint)" in r.name for r in rows)


def test_a_point_is_a_step_time_and_a_bound():
    args = types.SimpleNamespace(switches=Switches.from_env(), batches=[1], context=64,
                                 warmup=1, steps=2)
    model = bench.random_at("llama", TINY)
    ((batch, (step, bound)),) = bench.measure(model, make_backend("numba"), args,
                                              time.perf_counter).items()
    assert batch == 1 and step > 0 and bound > 0

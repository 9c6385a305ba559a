"""The 70B / 4×A100 cost model on known points (docs/design.md §7, docs/facts.md "Data")."""

from __future__ import annotations

import pytest

from sim.cost_model import Curve, ModelSpec

FLOOR_S = 0.0170  # 34.75 GB of weights per GPU ÷ 2.04 TB/s


def test_model_shapes_give_the_design_numbers():
    m = ModelSpec()
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert m.streamed_weight_bytes / 4 == pytest.approx(34.75e9, rel=0.01)


def test_vllm_latency_point_within_the_stated_error(cost):
    # vLLM 0.6.6, batch 8, 32-token prompts, 128 output tokens: 4.946 s ≈ 38.6 ms a step.
    total = cost.step_time([(32, 0)] * 8) + sum(cost.decode_step_time(8, 32 + k)
                                                for k in range(127))
    assert total / 128 == pytest.approx(0.0386, rel=0.10)  # docs state −5.3 %


@pytest.mark.parametrize("batch", [1, 2, 8, 32, 128, 256])
@pytest.mark.parametrize("context", [0, 1, 1024, 8192])
def test_decode_never_beats_the_weights_floor(cost, batch, context):
    t = cost.decode_step_time(batch, context)
    assert t >= FLOOR_S
    # ... nor the floor with its own KV reads added.
    assert t >= cost.floor_s(batch * (context + 1))


def test_mixed_steps_never_beat_the_floor(cost):
    assert cost.step_time([(1, 100)] * 4 + [(512, 0)]) >= FLOOR_S
    assert cost.step_time([(1, 0)], num_sampled=0) >= FLOOR_S


def test_prefill_1024_tokens_is_compute_bound_and_plausible(cost):
    t = cost.prefill_time(1024)
    assert t >= 0.113  # 141.6 TFLOP at 100 % of 4 × 312 TFLOPS
    assert t <= 0.113 / 0.35  # and above 35 % of peak (docs/design.md §7: ≈ 220 ms in practice)


def test_step_time_grows_with_tokens_batch_and_context(cost):
    prefills = [cost.prefill_time(n) for n in (1, 16, 100, 512, 1000, 4096, 40_000, 100_000)]
    assert prefills == sorted(prefills) and prefills[0] < prefills[-1]
    decodes = [cost.decode_step_time(b, 1024) for b in (1, 8, 64, 128, 256, 512)]
    assert decodes == sorted(decodes) and decodes[0] < decodes[-1]
    contexts = [cost.decode_step_time(64, c) for c in (0, 512, 2048, 8192)]
    assert contexts == sorted(contexts) and contexts[0] < contexts[-1]


def test_kv_pool_fits_in_the_device_after_weights(cost):
    blocks = cost.num_kv_blocks(16)
    per_gpu = blocks * 16 * ModelSpec().kv_bytes_per_token / 4
    weights = ModelSpec().weight_bytes / 4
    assert per_gpu + weights < 80 * 2**30
    assert blocks * 16 > 128 * 2048  # 128 sequences of 2 k context fit


def test_curve_is_monotone_interpolates_and_extrapolates():
    noisy = Curve([(1, 5.0), (2, 3.0), (4, 4.0), (8, 8.0), (16, 16.0)])
    ys = [noisy(x) for x in (1, 2, 3, 4, 6, 8, 16)]
    assert ys == sorted(ys)  # the dip at x = 2 is pooled away
    assert noisy(1) == noisy(2) == pytest.approx(4.0)  # 5 and 3 pooled to their mean
    line = Curve([(0, 0.0), (10, 10.0), (20, 20.0)])
    assert line(15) == pytest.approx(15.0)
    assert line(40) == pytest.approx(40.0)  # linear beyond the last point
    assert line(-5) == 0.0

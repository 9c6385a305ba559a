"""bench_executor's breakdown: where a decode step's time goes, with the layers in one native
call (their phases from the decoder's own clock) and in the per-op loop (wrapped functions)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_executor import DecodeRun, breakdown
from executor_svc.models.decoder import DecoderModel
from kernels import make_backend
from kernels.native_decoder import NativeDecoder

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return DecoderModel.load(path)


def _run(model) -> dict[str, float]:
    run = DecodeRun(model, make_backend("numba"), 4, 40, 8)
    run.timed(1, 1)
    return breakdown(run, model, 4)


def test_the_native_decoders_phases_are_counted_once(tiny):
    if tiny._decoder is None:
        pytest.skip("no native kernels here: every step takes the per-op loop")
    ms = _run(tiny)
    for phase in NativeDecoder.PHASES:
        assert ms[phase] > 0, phase
    # The phases are inside the forward's wall time: counted twice, the rest would go negative.
    assert ms["other forward ops"] >= 0 and ms["rest of execute"] >= 0
    assert tiny._decoder.phase_seconds is None  # the bench leaves the decoder as it was


def test_the_per_op_loop_is_broken_down_by_wrapped_functions(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "_decoder", None)
    ms = _run(tiny)
    assert ms["layer matmuls"] > 0 and ms["attention"] > 0 and ms["KV write"] > 0
    assert "SwiGLU" not in ms and ms["other forward ops"] >= 0

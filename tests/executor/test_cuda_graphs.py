"""Decode-step CUDA graphs (executor_svc/cuda_graphs.py) on the CPU: bucket choice, the
fallback decision, padding; and the graphs' static-buffer path run eagerly through the
Triton kernels under TRITON_INTERPRET, against the plain forward on the same steps (the
capture itself needs a GPU: scripts/gpu_check.sh)."""

from __future__ import annotations

import os

import pytest
import torch

_OLD_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # before kernels/triton_kernels.py is imported

from executor_svc.batch import SequenceState, build_inputs  # noqa: E402
from executor_svc.cuda_graphs import (  # noqa: E402
    BUCKETS,
    DecodeGraphs,
    bucket_for,
    choose,
    pad_rows,
)
from executor_svc.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from executor_svc.random_model import random_config, random_model  # noqa: E402
from executor_svc.sampler import SamplingConfig  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    yield
    if _OLD_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _OLD_INTERPRET


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (2, 2), (3, 4), (33, 64), (128, 128),
                                           (129, 256), (256, 256), (257, None), (0, None)])
def test_a_batch_takes_the_smallest_bucket_that_holds_it(n, bucket):
    assert bucket_for(n, BUCKETS) == bucket


def test_only_decode_steps_that_fit_a_captured_graph_replay_one():
    captured = (1, 2, 4, 8)
    assert choose((1, 1, 1), 3, 5, captured, 8).bucket == 4
    for args, why in [(((1, 7, 1), 3, 5), "prefill or chunk"),
                      (((1, 1), 1, 5), "does not sample"),
                      (((1,) * 9, 9, 5), "above the largest captured bucket (8)"),
                      (((1, 1), 2, 9), "wider than the captured 8"),
                      (((), 0, 1), "prefill or chunk")]:
        choice = choose(*args, captured, 8)
        assert choice.bucket is None and why in choice.reason


def test_padding_repeats_the_last_real_row():
    assert pad_rows(3, 8, "cpu").tolist() == [0, 1, 2, 2, 2, 2, 2, 2]
    assert pad_rows(4, 4, "cpu").tolist() == [0, 1, 2, 3]


pytest.importorskip("triton", reason="triton is not installed (the test extra pins it)")

_SHAPE = dict(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
              head_dim=16, vocab_size=97, max_position_embeddings=128)


def _decode_step(seqs: list[SequenceState], block_size: int):
    return build_inputs([(s, 1) for s in seqs], block_size, "cpu")


def test_the_static_path_gives_the_plain_forwards_logits_and_cache():
    """Three sequences of different lengths (bucket 4: one padded row) decode twice through
    the graphs' buffers and, on a copy of the cache, through the plain forward with the
    Triton backend: the same logits and cache, and padding wrote nothing else."""
    from kernels.triton_attention import TritonAttentionBackend

    torch.manual_seed(0)
    config = random_config("llama", **_SHAPE)
    model = random_model(config, dtype=torch.float32, native_gemm=False)
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32, 4)
    kv = KVCache(spec, 24)
    # A prompt's K/V in the cache as a prefill would leave it (random: what matters is that
    # both paths read the same), blocks out of order.
    kv.device_pool.normal_()
    tables = [[5, 2, 13], [7, 1, 9], [3, 11]]
    lengths = [6, 10, 2]  # tokens computed; the next decode computes one more
    seqs = [SequenceState(i, list(range(10, 10 + n + 1)), n, t, SamplingConfig(), n, 0)
            for i, (n, t) in enumerate(zip(lengths, tables, strict=True))]
    graphs = DecodeGraphs(model, kv, max_batch=8, max_blocks=4, buckets=(1, 2, 4, 8),
                          replay=False)
    graphs.capture()
    reference_kv = KVCache(spec, 24)
    reference_kv.device_pool.copy_(kv.device_pool)
    backend = TritonAttentionBackend()
    slots = torch.zeros(kv.num_blocks * 4, dtype=torch.bool)
    for _ in range(2):
        inputs = _decode_step(seqs, 4)
        got = graphs.run(inputs)
        want = model.forward(inputs.input_ids, inputs.positions, inputs.slot_mapping,
                             inputs.meta, backend, reference_kv, inputs.sample_rows)
        assert got.shape == (3, config.vocab_size)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # The step's slots hold close values (a 4-row GEMM rounds unlike a 3-row one);
        # every other slot is untouched, bit for bit: the padded row wrote nowhere else.
        slots[inputs.slot_mapping] = True  # this step's and the ones before
        got_pool, want_pool = (p.flatten(2, 3) for p in (kv.device_pool,
                                                         reference_kv.device_pool))
        torch.testing.assert_close(got_pool[:, :, slots], want_pool[:, :, slots], atol=1e-5,
                                   rtol=1e-5)
        assert torch.equal(got_pool[:, :, ~slots], want_pool[:, :, ~slots])
        for s in seqs:
            s.num_computed += 1
            s.token_ids.append(int(got[s.seq_id].argmax()))
    assert graphs.run(build_inputs([(seqs[2], 1)], 4, "cpu")).shape == (1, config.vocab_size)
    seqs[0].num_computed -= 1  # a two-token chunk: no graph, the caller runs it eagerly
    assert graphs.run(build_inputs([(seqs[0], 2)], 4, "cpu")) is None


def test_auto_dtype_is_bfloat16_on_a_gpu_and_float32_on_the_cpu_where_no_graphs_run():
    from executor_svc.device import decode_graphs, resolve_dtype

    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype("float16", torch.device("cuda", 0)) == "float16"
    model = random_model(random_config("llama", **_SHAPE), dtype=torch.float32, native_gemm=False)
    kv = KVCache(KVCacheSpec(1, 2, 16, torch.float32, 4), 4)
    assert decode_graphs(model, kv, enforce_eager=False) is None  # not on CUDA

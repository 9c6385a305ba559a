"""The forward pass on any Llama-family HF dir: a tiny random model with an untied LM head,
GQA and llama3 rope scaling, checked against transformers' logits."""

from __future__ import annotations

import pytest
import torch

from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.models import registry
from executor_svc.models.decoder import DecoderModel
from executor_svc.models.ops import rope_inv_freq
from kernels import make_backend, native
from kernels.attention import AttentionMetadata
from kernels.torch_backend import TorchAttentionBackend

transformers = pytest.importorskip("transformers")

ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, rope_parameters=ROPE, eos_token_id=[3, 4],
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return path, model


def test_config_reads_untied_head_gqa_and_rope_scaling(tiny_dir):
    path, _ = tiny_dir
    config = registry.read_config(path)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert not config.tie_word_embeddings and config.eos_token_ids == (3, 4)
    assert config.rope_scaling is not None and config.rope_theta == 50000.0


def test_llama3_rope_frequencies_match_transformers(tiny_dir):
    path, hf = tiny_dir
    ours = rope_inv_freq(registry.read_config(path))
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq.float())


@pytest.mark.parametrize("backend_name", ["torch", "numba"])
@pytest.mark.parametrize("gemm", ["native", "torch"])  # packed weights (where they build) or not
def test_paged_forward_matches_transformers_logits(tiny_dir, backend_name, gemm):
    path, hf = tiny_dir
    # CONTINUUM_NATIVE_GEMM=1 / 0, as the executor passes it on (executor_svc/settings.py).
    model = DecoderModel.load(path, native_gemm=gemm == "native")
    assert model.lm_head is not model.embed
    packed = isinstance(model.layers[0].w13, native.PackedWeight)
    assert packed == (gemm == "native" and native.load() is not None)
    _check_three_steps(model, hf, make_backend(backend_name), torch.float32, tol=1e-4)


# Tolerances ~10x the error seen (fp16 1.8e-5, bf16 1.1e-4).
@pytest.mark.parametrize("kv_dtype,tol", [(torch.float16, 2e-4), (torch.bfloat16, 1e-3)])
@pytest.mark.parametrize("backend_name", ["torch", "numba"])
def test_a_narrow_kv_cache_stays_close_to_transformers(tiny_dir, kv_dtype, tol, backend_name):
    # --kv-cache-dtype: an fp32 model over a float16 / bfloat16 pool (half the bytes).
    path, hf = tiny_dir
    _check_three_steps(DecoderModel.load(path), hf, make_backend(backend_name), kv_dtype, tol)


def _check_three_steps(model, hf, backend, kv_dtype, tol):
    """Prefill 149 tokens in two chunks, then one decode, through blocks in shuffled order;
    each step's sampled rows against transformers' logits."""
    c = model.config
    kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype, 4), 48)
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]  # [150, V]
    table = torch.randperm(48, generator=torch.Generator().manual_seed(2))[:38].tolist()
    for start, end in [(0, 100), (100, 149), (149, 150)]:
        pos = torch.arange(start, end)
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in pos.tolist()])
        meta = AttentionMetadata.build([end - start], [end], [table], 4)
        rows = torch.tensor([0, end - start - 1])
        got = model.forward(ids[start:end], pos, slots, meta, backend, kv, rows)
        torch.testing.assert_close(got, want[[start, end - 1]], atol=tol, rtol=tol)
    assert kv.device_pool.dtype == kv_dtype


def test_bfloat16_forward_runs_close_to_fp32(tiny_dir):
    path, hf = tiny_dir
    model = DecoderModel.load(path, dtype=torch.bfloat16)
    c = model.config
    kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, torch.bfloat16, 4), 8)
    ids = torch.arange(10, 30)
    with torch.no_grad():
        want = hf(ids[None]).logits[0, -1]
    meta = AttentionMetadata.build([20], [20], [[0, 1, 2, 3, 4]], 4)
    got = model.forward(ids, torch.arange(20), torch.arange(20), meta, TorchAttentionBackend(),
                        kv, torch.tensor([19]))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[0], want, atol=0.05, rtol=0.05)


# Per step, the new tokens of each of 3 sequences: a prefill of the three (chunks), a mixed
# step (two decodes and seq 2's second chunk over its cached prefix), two decode-only steps.
STEPS = [[10, 5, 7], [1, 1, 4], [1, 1, 1], [1, 1, 1]]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_the_native_decoder_equals_the_per_op_layers(tiny_dir, kv_dtype):
    """A step runs its layers in one native call (kernels/cpu_decoder.cpp), chunks' attention
    called back per layer: the same logits and K/V, bit for bit, as the per-op loop; another
    backend keeps the loop."""
    path, _ = tiny_dir
    model = DecoderModel.load(path)
    decoder = model._decoder
    if decoder is None:
        pytest.skip("no native kernels here: every step takes the per-op loop")
    c, bs = model.config, 4
    tables = [torch.randperm(60, generator=torch.Generator().manual_seed(3))[i::3][:12].tolist()
              for i in range(3)]

    def run(use_decoder: bool, backend) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
        calls: list[int] = []

        def counting(x, *rest):
            calls.append(x.shape[1])
            return decoder(x, *rest)

        model._decoder = counting if use_decoder else None
        kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype, bs), 60)
        gen = torch.Generator().manual_seed(4)
        lens = [0, 0, 0]
        logits = []
        try:
            for new in STEPS:
                ids = torch.randint(0, c.vocab_size, (sum(new),), generator=gen)
                pos = torch.cat([torch.arange(n0, n0 + n)
                                 for n0, n in zip(lens, new, strict=True)])
                owner = [i for i, n in enumerate(new) for _ in range(n)]
                slots = torch.tensor([tables[i][p // bs] * bs + p % bs
                                      for i, p in zip(owner, pos.tolist(), strict=True)])
                lens = [n0 + n for n0, n in zip(lens, new, strict=True)]
                meta = AttentionMetadata.build(new, lens, tables, bs)
                rows = torch.tensor(list(torch.cumsum(torch.tensor(new), 0) - 1))
                logits.append(model.forward(ids, pos, slots, meta, backend, kv, rows))
        finally:
            model._decoder = decoder
        return logits, kv.device_pool.clone(), calls

    fused, fused_pool, calls = run(True, make_backend("numba"))
    assert calls == [sum(new) for new in STEPS]
    looped, looped_pool, none = run(False, make_backend("numba"))
    assert none == []
    for a, b in zip(fused, looped, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fused_pool, looped_pool)
    _, _, other = run(True, make_backend("torch"))  # not the AVX2 kernel: the loop
    assert other == []


def test_an_error_in_a_chunks_attention_fails_the_step(tiny_dir, monkeypatch):
    path, _ = tiny_dir
    model = DecoderModel.load(path)
    if model._decoder is None:
        pytest.skip("no native kernels here")
    import kernels.torch_backend

    def broken(*args):
        raise RuntimeError("chunk attention broke")

    monkeypatch.setattr(kernels.torch_backend, "chunk_attention", broken)
    c = model.config
    kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, 4), 8)
    meta = AttentionMetadata.build([3], [3], [[1]], 4)
    with pytest.raises(RuntimeError, match="chunk attention broke"):
        model.forward(torch.tensor([5, 6, 7]), torch.arange(3), torch.arange(4, 7), meta,
                      make_backend("numba"), kv, torch.tensor([2]))


def test_the_native_decoder_refuses_a_slot_outside_the_pool(tiny_dir):
    path, _ = tiny_dir
    model = DecoderModel.load(path)
    if model._decoder is None:
        pytest.skip("no native kernels here")
    c = model.config
    kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, 4), 8)
    meta = AttentionMetadata.build([1], [3], [[1]], 4)
    with pytest.raises(IndexError, match="outside the pool"):
        model.forward(torch.tensor([5]), torch.tensor([2]), torch.tensor([32]), meta,
                      make_backend("numba"), kv, torch.tensor([0]))

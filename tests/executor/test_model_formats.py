"""The weight formats (executor_svc/weight_formats.py): the bundled GGUF served in its own
Q4_1 / Q8_0 blocks with every weight equal to the fp32 conversion's (transformers' values),
its logits against transformers'; bf16 for an HF directory; the choice and its errors."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from executor_svc import weight_formats
from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.model_files import bundled_gguf
from executor_svc.models.decoder import DecoderModel
from kernels import make_backend, native, quant
from kernels.attention import AttentionMetadata

LIB = native.load()
needs_native = pytest.mark.skipif(LIB is None, reason="no AVX2 CPU or compiler: fp32 only")


@needs_native
def test_the_default_serves_the_gguf_blocks_with_transformers_values(model, model_dir):
    # The suite's `model` fixture loads with every switch at its default: auto -> hybrid
    # (native where its fp32 copy would not fit in memory).
    if json.loads((model_dir / "config.json").read_text())["_name_or_path"] != bundled_gguf().stem:
        pytest.skip("$CONTINUUM_TEST_MODEL is not the bundled Q4_1 GGUF")
    assert model.weight_format == weight_formats.resolve("auto", model_dir, LIB, True, False)
    assert model.weight_format in ("hybrid", "native")
    wide = model.weight_format == "hybrid"
    assert all((w.wide_nbytes > 0) == wide for lay in model.layers
               for w in (lay.wqkv, lay.wo, lay.w13, lay.w2))
    assert (model.lm_head.wide_nbytes == 49152 * 576 * 4) == wide
    # q/k/v are all Q4_1: one segment (one GEMM call); the embedding Q8_0.
    assert model.layers[0].wqkv.formats == ("Q4_1",) and model.embed.formats == ("Q8_0",)
    assert model.lm_head is model.embed  # tied: one copy of the Q8_0 blocks serves both
    fp32 = load_file(str(model_dir / "model.safetensors"))  # gguf.dequantize + un-permute
    for i in (0, 29):
        p = f"model.layers.{i}."
        layer = model.layers[i]
        want = {"wqkv": [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                "wo": [p + "self_attn.o_proj.weight"], "w2": [p + "mlp.down_proj.weight"],
                "w13": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]}
        for name, parts in want.items():
            expected = torch.cat([fp32[n] for n in parts])
            assert torch.equal(getattr(layer, name).dequantize(), expected), (i, name)
    assert torch.equal(model.embed.dequantize(), fp32["model.embed_tokens.weight"])
    # The step streams the blocks: ~4.7x fewer weight bytes than fp32.
    ours = sum(weight_formats.streamed_bytes(w) for lay in model.layers
               for w in (lay.wqkv, lay.wo, lay.w13, lay.w2)) + model.lm_head.nbytes
    assert ours * 4 < sum(t.numel() * 4 for n, t in fp32.items() if n.endswith("proj.weight")
                          or n == "model.embed_tokens.weight")


@needs_native
def test_native_logits_match_transformers(model, hf_model):
    """A 40-token prefill in two chunks and one decode step, the sampled rows against
    transformers' fp32 logits over the same (dequantized) weights."""
    c = model.config
    kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, 16), 8)
    ids = torch.randint(0, c.vocab_size, (41,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf_model(ids[None]).logits[0]
    backend = make_backend(None)
    for start, end in [(0, 25), (25, 40), (40, 41)]:
        meta = AttentionMetadata.build([end - start], [end], [[0, 1, 2]], 16)
        rows = torch.tensor([0, end - start - 1])
        got = model.forward(ids[start:end], torch.arange(start, end), torch.arange(start, end),
                            meta, backend, kv, rows)
        torch.testing.assert_close(got, want[[start, end - 1]], atol=2e-3, rtol=2e-3)
        assert torch.equal(got.argmax(-1), want[[start, end - 1]].argmax(-1))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return path, hf


@needs_native
def test_bf16_weights_for_an_hf_dir_stay_close(tiny_dir):
    path, hf = tiny_dir
    model = DecoderModel.load(path, weight_format="bf16")
    assert model.layers[1].w13.formats == ("BF16",) and model.lm_head.formats == ("BF16",)
    w = model.layers[1].w13.dequantize()
    gate = hf.model.layers[1].mlp.gate_proj.weight.detach()
    assert torch.equal(w[:128], gate.to(torch.bfloat16).float())
    c = model.config
    kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, 16), 4)
    ids = torch.arange(5, 25)
    meta = AttentionMetadata.build([20], [20], [[0, 1]], 16)
    got = model.forward(ids, torch.arange(20), torch.arange(20), meta, make_backend(None), kv,
                        torch.tensor([19]))
    with torch.no_grad():
        want = hf(ids[None]).logits[0, -1]
    torch.testing.assert_close(got[0], want, atol=0.03, rtol=0.03)  # bf16 weights: ~1e-2


def test_the_choice_and_its_errors(tiny_dir, model_dir):
    path, _ = tiny_dir
    assert weight_formats.resolve("auto", path, LIB, True, False) == "fp32"  # no GGUF behind
    assert weight_formats.resolve("fp32", model_dir, LIB, True, False) == "fp32"
    with pytest.raises(ValueError, match="not a GGUF conversion"):
        weight_formats.resolve("native", path, LIB, True, False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        weight_formats.resolve("native", model_dir, LIB, True, True)
    with pytest.raises(ValueError, match="native GEMM"):
        weight_formats.resolve("bf16", path, None, True, False)
    with pytest.raises(ValueError, match="expected one of"):
        weight_formats.resolve("int3", path, LIB, True, False)
    with pytest.raises(ValueError, match="hybrid is not available.*not a GGUF conversion"):
        weight_formats.resolve("hybrid", path, LIB, True, False)
    if LIB is not None:
        assert weight_formats.resolve("auto", model_dir, LIB, False, False) == "fp32"
        assert weight_formats.resolve("native", model_dir, LIB, True, False) == "native"
        assert weight_formats.resolve("hybrid", model_dir, LIB, True, False) == "hybrid"
        # auto: hybrid while the fp32 copy (540 MB here) takes <= 1/8 of available memory.
        copy = weight_formats.wide_copy_bytes(model_dir)
        assert 500 << 20 < copy < 600 << 20
        for free, want in ((copy * 8, "hybrid"), (copy * 8 - 1, "native"), (None, "hybrid")):
            with mock.patch.object(weight_formats, "available_memory", return_value=free):
                assert weight_formats.resolve("auto", model_dir, LIB, True, False) == want


def test_available_memory_is_the_tighter_of_the_host_and_its_cgroup(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 24000000 kB\nMemAvailable: 2000000 kB\n")
    assert weight_formats.available_memory(tmp_path) == 2_048_000_000
    cgroup = tmp_path / "sys/fs/cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text("max\n")  # v2, no limit
    (cgroup / "memory.current").write_text("1000\n")
    assert weight_formats.available_memory(tmp_path) == 2_048_000_000
    (cgroup / "memory.max").write_text(f"{4 << 30}\n")  # a 4 GiB container, 3.5 GiB used
    (cgroup / "memory.current").write_text(f"{7 << 29}\n")
    assert weight_formats.available_memory(tmp_path) == 1 << 29
    (cgroup / "memory.max").unlink()
    (cgroup / "memory").mkdir()  # v1
    (cgroup / "memory/memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    (cgroup / "memory/memory.usage_in_bytes").write_text(f"{1 << 29}\n")
    assert weight_formats.available_memory(tmp_path) == 1 << 29
    assert weight_formats.available_memory(tmp_path / "nowhere") is None


@needs_native
def test_hybrid_outputs_are_the_native_formats_bits(model_dir):
    """The fp32 copy that hybrid's wide GEMMs read gives the blocks' panel path's bits: a
    41-token prefill (wide GEMMs) and a 6-row decode, logits equal to the last bit."""
    models = {f: DecoderModel.load(model_dir, weight_format=f) for f in ("native", "hybrid")}
    assert models["hybrid"].layers[3].w13.wide_nbytes == 2 * 1536 * 576 * 4
    assert models["native"].layers[3].w13.wide_nbytes == 0
    c = models["native"].config
    ids = torch.randint(0, c.vocab_size, (47,), generator=torch.Generator().manual_seed(5))
    got = {}
    for fmt, model in models.items():
        kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, 16), 8)
        out = []
        for start, end in [(0, 41), (41, 47)]:
            meta = AttentionMetadata.build([end - start], [end], [[0, 1, 2]], 16)
            rows = torch.arange(end - start)
            out.append(model.forward(ids[start:end], torch.arange(start, end),
                                     torch.arange(start, end), meta, make_backend(None), kv, rows))
        got[fmt] = out
    for a, b in zip(got["native"], got["hybrid"], strict=True):
        assert torch.equal(a, b)


def test_the_blocks_are_saved_beside_the_conversion_and_not_globbed(model_dir):
    # gguf_blocks.st: safetensors the fp32 loaders' *.safetensors glob does not pick up.
    assert weight_formats.has_native(model_dir)
    assert [p.name for p in model_dir.glob("*.safetensors")] == ["model.safetensors"]
    blocks = weight_formats.read_native(model_dir)
    q = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert (q.format, q.shape) == (3, (576, 576)) and q.data.dtype.name == "uint8"
    assert blocks["model.norm.weight"].dtype == torch.float32


def test_a_row_permutation_of_blocks_is_exact():
    raw = quant.RawTensor(2, (4, 32), torch.arange(4 * 18, dtype=torch.uint8).view(4, 18).numpy())
    assert (raw.take_rows([2, 0, 3, 1]).data[1] == raw.data[0]).all()

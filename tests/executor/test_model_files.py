"""Model resolution and the GGUF -> HF conversion, checked against transformers' own GGUF
loading (weights, tokenizer) and the chat template."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import jinja2
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from executor_svc.model_files import ModelError, bundled_gguf, resolve_model

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent

TEXTS = [
    "Hello world",
    "  leading spaces\tand\ttabs\n\nnewlines",
    "héllo wörld, naïve café — 你好，世界 🤖🎉👩‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # ok 12345 3.14159",
    "Ümlaut's can't won't y'all",
]


def test_bundled_model_converts_to_an_hf_dir(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert config["tie_word_embeddings"] and config["eos_token_id"] == 2
    assert not any(p.name.startswith(".tmp") for p in model_dir.parent.iterdir())


def test_cached_and_hf_dirs_resolve_fast(model_dir):
    start = time.perf_counter()
    # The cache the suite's model lives in: $CONTINUUM_CACHE_DIR (CI sets it), read
    # once by the settings as the executor reads it, not by resolve_model itself.
    from executor_svc.settings import Switches

    assert resolve_model(None, Switches.from_env().cache_dir) == model_dir
    assert resolve_model(str(model_dir)) == model_dir
    assert time.perf_counter() - start < 1.0


def test_bad_paths_raise_model_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all" * 10)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "m.safetensors"):
        (gpt2 / name).write_text(json.dumps({"model_type": "gpt2"}))
    cases = {"missing": "does not exist", "notes.txt": "neither", "empty": "missing",
             "bad.gguf": "GGUF", "gpt2": "not supported"}
    for name, message in cases.items():
        with pytest.raises(ModelError, match=message):
            resolve_model(str(tmp_path / name), cache_dir=str(tmp_path / "cache"))
    leftovers = list((tmp_path / "cache" / "models").iterdir())
    assert leftovers == []  # a failed conversion leaves nothing behind


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_cli_prints_the_dir_or_one_error_line(model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    ok = subprocess.run([sys.executable, "-m", "executor_svc.model_files", str(model_dir)],
                        capture_output=True, text=True, env=env, check=False)
    assert (ok.returncode, ok.stdout.strip()) == (0, str(model_dir))
    bad = subprocess.run([sys.executable, "-m", "executor_svc.model_files", str(tmp_path / "x")],
                         capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "does not exist" in bad.stderr


def test_weights_equal_transformers_gguf_processing(model_dir):
    """Per tensor: gguf's dequantization + transformers' Llama Q/K un-permutation."""
    gguf = pytest.importorskip("gguf")
    ggml = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    config = json.loads((model_dir / "config.json").read_text())
    processor = ggml.LlamaTensorProcessor(config=config)
    ours = load_file(str(model_dir / "model.safetensors"))
    names = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight"}
    for layer in (0, 29):
        for g, h in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                     ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                     ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                     ("ffn_down", "mlp.down_proj"), ("attn_norm", "input_layernorm"),
                     ("ffn_norm", "post_attention_layernorm")]:
            names[f"blk.{layer}.{g}.weight"] = f"model.layers.{layer}.{h}.weight"
    reader = gguf.GGUFReader(bundled_gguf())
    for tensor in reader.tensors:
        if tensor.name in names:
            weights = gguf.dequantize(tensor.data, tensor.tensor_type)
            expected = processor.process(weights, tensor.name).weights
            assert torch.equal(ours[names[tensor.name]], torch.from_numpy(expected.copy()))
    assert len(ours) == 1 + 1 + 30 * 9  # embeddings, final norm, 9 per layer; lm_head tied


@pytest.mark.skipif(not os.environ.get("CONTINUUM_SLOW_TESTS"),
                    reason="~30 s: set CONTINUUM_SLOW_TESTS=1")
def test_weights_equal_transformers_gguf_model(model_dir):
    transformers = pytest.importorskip("transformers")
    path = bundled_gguf()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).state_dict()
    ours = load_file(str(model_dir / "model.safetensors"))
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied to the embeddings
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name


def test_tokenizer_equals_transformers_gguf_tokenizer(model_dir):
    transformers = pytest.importorskip("transformers")
    path = bundled_gguf()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.token_to_id("<|im_end|>") == 2 and ours.get_vocab_size() == 49152


def test_chat_template_renders(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    template = jinja2.Environment().from_string(config["chat_template"])
    text = template.render(messages=[{"role": "user", "content": "What is the capital?"}],
                           add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_truncated_copy_for_the_gpu_check_loads_with_the_same_tokenizer(model_dir, tmp_path):
    """scripts/gpu_bundle.py's smaller model (the whole GGUF is too big to carry to a lent
    GPU machine): the first blocks only, everything else as in the bundled file."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_bundle import truncate_gguf
    finally:
        sys.path.pop(0)
    small = tmp_path / "small.gguf"
    truncate_gguf(bundled_gguf(), small, 2)
    assert small.stat().st_size < bundled_gguf().stat().st_size / 2
    converted = resolve_model(str(small), cache_dir=str(tmp_path / "cache"))
    config = json.loads((converted / "config.json").read_text())
    full = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    differ = {"num_hidden_layers", "_name_or_path"}
    assert {k: v for k, v in config.items() if k not in differ} == \
        {k: v for k, v in full.items() if k not in differ}
    assert (converted / "tokenizer.json").read_text() == (model_dir / "tokenizer.json").read_text()
    weights, reference = load_file(converted / "model.safetensors"), load_file(
        model_dir / "model.safetensors")
    assert not any(name.startswith("model.layers.2.") for name in weights)
    for name, tensor in weights.items():  # the kept tensors are the same values
        assert torch.equal(tensor, reference[name]), name
    with pytest.raises(SystemExit, match="has only"):
        truncate_gguf(bundled_gguf(), tmp_path / "too_many.gguf", 1000)

